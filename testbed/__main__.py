from testbed.cli.main import main

raise SystemExit(main())
