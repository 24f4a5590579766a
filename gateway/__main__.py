from mstar.gateway.server import main

raise SystemExit(main())
