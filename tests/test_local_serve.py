"""testing/local_serve's ports: every cluster's ports distinct, within a cluster and across clusters of one run."""

from testing.local_serve import free_port, free_ports


def test_ports_handed_out_are_never_handed_out_again():
    chosen = free_ports(64)
    later = [free_port() for _ in range(64)]
    assert len(set(chosen)) == 64 and len(set(later)) == 64 and not set(chosen) & set(later)
