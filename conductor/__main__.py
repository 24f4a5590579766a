from mstar import grpc_env, lifetime

lifetime.adopt()  # die with the launcher
grpc_env.apply()  # before anything imports grpc

from mstar.conductor.server import main

main()
