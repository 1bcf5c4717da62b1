"""Deploying the roles, above them: Ray placement (``placement``), each role as a Ray actor
(``cache_actor``, ``verifier_actor``, ``drafter_actor``), and the emulation of edge devices a
simulated fleet runs with (``device_profiles``, ``link_emulation``, ``device_emulation``).
``edgespec deploy`` and ``edgespec simulate`` use it; the roles never import it. ("Fleet" alone
names the devices; the fleet table is Cacheback's n-gram table,
``edgespec.protocol.fleet_table``.)"""
