from turnscale.cli import main

raise SystemExit(main())
