from actors.main import main

raise SystemExit(main())
