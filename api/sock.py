"""The flask-sock extension, created unbound and bound in the app factory."""

from flask_sock import Sock

sock = Sock()
