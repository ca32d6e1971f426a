"""The coordinator address is checked where it is given (``distributed.coordinator`` or
``OLMAX_COORDINATOR``): HOST:PORT with a port in 1..65535, not a URL; one line naming the key,
before any connection is tried."""

from __future__ import annotations

import pytest

from olmax.config import DistributedConfig
from olmax.errors import ConfigError
from olmax.parallel.distributed import resolve_settings

BAD = [
    ("node0", r"expected HOST:PORT, got 'node0' \(no port\)"),
    (":8476", r"expected HOST:PORT, got ':8476' \(no host\)"),
    ("node0:0", r"the port must be a number in 1\.\.65535 \(got 'node0:0'\)"),
    ("node0:65536", r"the port must be a number in 1\.\.65535"),
    ("node0:http", r"the port must be a number in 1\.\.65535"),
    ("http://node0:8476", r"expected HOST:PORT, not a URL"),
    ("::1:8476", r"expected HOST:PORT with an IPv6 host in brackets"),
]


@pytest.mark.parametrize("address,expect", BAD)
def test_a_bad_coordinator_key_is_refused_naming_it(address, expect):
    with pytest.raises(ConfigError, match=r"^distributed\.coordinator: " + expect):
        DistributedConfig(coordinator=address)


@pytest.mark.parametrize("address,expect", BAD[:3])
def test_a_bad_coordinator_variable_is_refused_naming_it(address, expect):
    with pytest.raises(ConfigError, match=r"^OLMAX_COORDINATOR: " + expect):
        resolve_settings(DistributedConfig(), {"OLMAX_COORDINATOR": address})


@pytest.mark.parametrize("address", ["node0:8476", "10.0.0.1:1", "[::1]:65535", "job-0.job:8476"])
def test_good_addresses_pass(address):
    assert DistributedConfig(coordinator=address).coordinator == address
    assert resolve_settings(DistributedConfig(), {"OLMAX_COORDINATOR": address})["coordinator"] == address


def test_process_id_must_be_below_the_count():
    with pytest.raises(ConfigError, match=r"distributed\.process_id \(4\) must be below "
                                          r"distributed\.num_processes \(4\)"):
        DistributedConfig(num_processes=4, process_id=4)
