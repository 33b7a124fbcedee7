"""Many hosts on one machine: the multi-host test harness.

Each host is a Linux network namespace with its own address on a private switch (a bridge in a
namespace of its own); the product's real commands run on them, and faults are injected per host.
Nothing leaves the machine: addresses (``10.213.0.0/24``) and routes exist only inside the
harness's namespaces. It needs root and iproute2; where namespaces cannot be made, the tests
that use them fail saying so (they are marked ``slow``: `make test-slow`, `.ci/run`).

- :mod:`~tests.hosts.netns`: :class:`Network` (a context manager; the ``network`` fixture of
  ``conftest.py`` gives one per test) and :class:`Host`: ``run``/``popen``/``python`` (a
  command on the host), ``call`` (a Python function on a thread inside the host's namespace,
  for admin clients), ``kill_all`` (``kill -9`` of every process on it), ``link_down`` /
  ``link_up`` (pull the cable at the switch, plug it back). Names are per test process and
  counter, cleanup is guaranteed, and leftovers of crashed runs are removed.
- :mod:`~tests.hosts.relay`: a delaying, counting TCP relay (asyncio). Link delay is ~0.25 ms
  per direction per hop: by netem where the kernel has it (checked once, in a throwaway
  namespace), else by the relay in front of every Redis node (``Network.delay_method``
  records which). The relay counts commands and round trips per client host either way.
- :mod:`~tests.hosts.redis_topologies`: :class:`SingleRedis` (what the product speaks today),
  :class:`SentinelRedis` (master, replicas, a sentinel on each host) and :class:`ClusterRedis`
  (3 primaries with a replica each, by ``redis-cli --cluster create``), each on its own
  host(s). A new topology subclasses :class:`RedisTopology`: its nodes, its ``url`` (what
  ``--redis`` gets) and ``admin`` access.
- :mod:`~tests.hosts.services`: `worker start` and `gateway start` on hosts, the load
  generator (:mod:`~tests.hosts.load`, run on a client host, results as JSON) and the figures
  the fault tests print.

Typical use (test_multihost.py builds a whole stack this way)::

    def test_x(network, prefix):
        redis = SingleRedis(network.host("redis")).start()
        worker = network.host("w1")
        start_worker(worker, redis.url, prefix, tag=1)  # `worker start` on that host
        ...
        worker.kill_all()  # or worker.link_down(); ...; worker.link_up()
"""
