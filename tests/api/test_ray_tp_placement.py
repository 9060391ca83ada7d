"""A tensor-parallel engine replica on Ray Serve: the deployment options reserve one placement
group per replica (its ranks are the replica's child processes, on its node), checked without
starting Ray; one rank keeps the options it always had."""

from __future__ import annotations

import pytest

from loraplex.api.cluster.ray_serve import _replica_on_gpus, _replica_options, _tensor_parallel_placement
from loraplex.api.settings import ClusterConfig, ServerConfig

PLACEMENT_KEYS = {"placement_group_bundles", "placement_group_strategy"}


def options(tensor_parallel_size: int, gpus: bool, replica_cpus: float = 2.0, routing: str = "affinity") -> dict:
    # affinity: Ray's default router, so no Ray import is needed to build the options
    cluster = ClusterConfig(replicas=3, replica_cpus=replica_cpus, routing=routing)
    return _replica_options(ServerConfig(shutdown_timeout_s=7.0), cluster, tensor_parallel_size, gpus)


def test_one_rank_keeps_the_options_it_had_and_no_placement_group():
    expected = {"ray_actor_options": {"num_cpus": 2.0}, "max_ongoing_requests": 256, "health_check_period_s": 2,
                "graceful_shutdown_timeout_s": 7.0, "num_replicas": 3}
    assert options(1, gpus=False) == expected
    assert options(1, gpus=True) == expected  # a one-rank replica reserves what it did before, GPU or not
    cluster = ClusterConfig(replicas=3, replica_cpus=2.0, routing="affinity")
    assert _replica_options(ServerConfig(shutdown_timeout_s=7.0), cluster) == expected  # the defaults: one rank


def test_two_cpu_ranks_reserve_the_replica_cpus_each_on_one_node():
    got = options(2, gpus=False)
    assert got["ray_actor_options"] == {"num_cpus": 2.0}
    assert got["placement_group_bundles"] == [{"CPU": 2.0}, {"CPU": 2.0}]
    assert got["placement_group_strategy"] == "STRICT_PACK"
    assert {k: v for k, v in got.items() if k not in PLACEMENT_KEYS} == options(1, gpus=False)


def test_two_cuda_ranks_put_both_gpus_in_the_replica_actors_bundle():
    """The ranks inherit the actor's CUDA_VISIBLE_DEVICES, which Ray sets to the actor's own GPUs."""
    got = options(2, gpus=True)
    assert got["ray_actor_options"] == {"num_cpus": 2.0, "num_gpus": 2}
    assert got["placement_group_bundles"] == [{"CPU": 2.0, "GPU": 2}, {"CPU": 2.0}]
    assert got["placement_group_strategy"] == "STRICT_PACK"
    rest = {k: v for k, v in got.items() if k not in PLACEMENT_KEYS | {"ray_actor_options"}}
    assert rest == {k: v for k, v in options(1, gpus=False).items() if k != "ray_actor_options"}


@pytest.mark.parametrize("gpus", [False, True])
@pytest.mark.parametrize("size", [2, 3, 4, 8])
def test_a_replica_holds_its_ranks_cpus_and_gpus_the_actor_fitting_the_first_bundle(size, gpus):
    cpus = 1.5
    got = _tensor_parallel_placement(cpus, size, gpus)
    bundles = got["placement_group_bundles"]
    assert len(bundles) == size
    assert sum(b.get("CPU", 0) for b in bundles) == size * cpus
    assert sum(b.get("GPU", 0) for b in bundles) == (size if gpus else 0)
    actor = got["ray_actor_options"]
    assert actor["num_cpus"] <= bundles[0]["CPU"] and actor.get("num_gpus", 0) == bundles[0].get("GPU", 0)


def test_zero_replica_cpus_leaves_no_bundle_of_zeros():
    """Ray refuses a bundle whose resources are all 0."""
    assert PLACEMENT_KEYS.isdisjoint(options(2, gpus=False, replica_cpus=0))
    got = options(2, gpus=True, replica_cpus=0)
    assert got["placement_group_bundles"] == [{"GPU": 2}]
    assert got["ray_actor_options"] == {"num_cpus": 0, "num_gpus": 2}


def test_nonsense_tensor_parallel_size_is_refused():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        options(0, gpus=False)


def test_which_devices_put_a_replica_on_gpus():
    def no_cluster():
        raise AssertionError("the cluster is asked only for device auto")

    assert _replica_on_gpus("cuda", no_cluster) and _replica_on_gpus("cuda:1", no_cluster)
    assert not _replica_on_gpus("cpu", no_cluster)
    assert _replica_on_gpus("auto", lambda: 4.0)
    assert not _replica_on_gpus("auto", lambda: 0)


@pytest.mark.parametrize("routing", ["adapter", "round-robin", "affinity"])
@pytest.mark.parametrize("replica_cpus", [2.0, 0])
@pytest.mark.parametrize("size,gpus", [(1, False), (2, False), (2, True), (4, True)])
def test_ray_serve_accepts_the_options_without_a_running_ray(size, gpus, replica_cpus, routing):
    """Ray Serve's own checks (the actor within the first bundle, no bundle of zeros, the strategy)
    run when the deployment is declared; Ray is not started."""
    ray = pytest.importorskip("ray")
    from ray import serve

    class Replica:
        pass

    got = options(size, gpus, replica_cpus, routing)
    deployment = serve.deployment(Replica, name="Engine", **got)
    assert deployment.ray_actor_options == got["ray_actor_options"]
    assert not ray.is_initialized()
