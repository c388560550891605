from asyncengine.cli import main

raise SystemExit(main())
