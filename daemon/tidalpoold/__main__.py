from tidalpoold.cli import main

raise SystemExit(main())
