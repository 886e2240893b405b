from turnscale.learner.main import main

raise SystemExit(main())
