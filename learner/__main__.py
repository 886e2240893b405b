from learner.main import main

raise SystemExit(main())
