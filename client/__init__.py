"""Clients of the Switchyard HTTP API (the terminal chat).

Nothing here imports the server's packages: a client talks to a farm only
through its public HTTP and websocket API.
"""
