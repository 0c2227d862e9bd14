from moetrain.cli import main

raise SystemExit(main())
