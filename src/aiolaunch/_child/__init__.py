"""Code that runs in the supervisor's children: the workers and the zygote.

Every module here imports only the standard library and its siblings in this
folder (``tests/test_structure.py`` checks it): a worker pays for no import of
the supervisor's, and the zygote stays safe to fork.
"""
