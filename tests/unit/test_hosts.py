from llm_serving.hosts import is_loopback


def test_loopback_is_any_loopback_address_or_localhost():
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.1.2.3", "::1", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "10.0.0.2", "::", "node-2.example", "LOCALHOST.example"))
