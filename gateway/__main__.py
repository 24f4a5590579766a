from mstar import grpc_env

grpc_env.apply()  # before anything imports grpc

from mstar.gateway.server import main

raise SystemExit(main())
