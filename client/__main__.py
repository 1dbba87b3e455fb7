"""``python -m client`` runs the terminal chat (same as ``switchyard chat``)."""

import sys

from client.chat import main

sys.exit(main())
