from mstar import grpc_env

grpc_env.apply()  # before anything imports grpc

from mstar.conductor.server import main

main()
