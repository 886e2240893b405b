from turnscale.actors.main import main

raise SystemExit(main())
