from envhub.main import main

raise SystemExit(main())
