from aiolaunch._cli import main

raise SystemExit(main())
