from mstar.services.node_group.server import main

main()
