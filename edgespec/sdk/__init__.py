"""The client SDK's parts: its errors (``errors``), the wire request built and checked
(``request``), a call's streams resumed and put together (``stream``). Users import them from
``edgespec.client`` (or ``edgespec``), whose ``Client`` and ``AsyncClient`` use them."""
