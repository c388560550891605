from asyncengine.entrypoints.cli import main

raise SystemExit(main())
