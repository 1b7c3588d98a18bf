from grouprl.cli import main

raise SystemExit(main())
