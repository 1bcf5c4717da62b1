"""The ``edgespec`` commands: the top layer, composing the roles and the shared library."""
