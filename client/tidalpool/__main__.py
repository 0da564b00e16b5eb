from tidalpool.cli import main

raise SystemExit(main())
