"""Process launching (private).

The small interface the contexts use is :class:`._handle.WorkerHandle` - one
running worker: ``pid``, ``returncode`` (``None`` while alive), an ``exited``
event set the moment the exit is known, and ``signal_tree()``. Binary workers
(``_binary``) are asyncio subprocesses; function workers (``_function``) are
multiprocessing children. Neither waits on pipe EOF to notice an exit.

This ``__init__`` imports nothing: ``_child`` runs inside every function
worker and must stay cheap to import. ``_workers`` never imports ``_logs``.
"""
