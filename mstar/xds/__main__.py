from mstar import lifetime

lifetime.adopt()  # die with the launcher

from mstar.xds.server import main  # noqa: E402

main()
