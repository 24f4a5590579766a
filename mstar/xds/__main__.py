from mstar.xds.server import main

main()
