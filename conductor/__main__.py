from mstar.conductor.server import main

main()
