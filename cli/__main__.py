import sys

from workers.openmp import spin_briefly

spin_briefly()  # before torch loads libgomp

from cli.main import main  # noqa: E402

sys.exit(main())
