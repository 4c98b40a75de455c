"""pdserve's named actors on a Ray cluster: finding them (by name, in pdserve's namespace) and
killing them. Used by ``pdserve shutdown --address`` (``launch.shutdown_all``) and by the
router's own Shutdown call (``router_actor``)."""
from __future__ import annotations

from pdserve.workers.process.names import NAMESPACE, ROUTER_NAME


def pdserve_actor_names(namespace: str = NAMESPACE) -> list[str]:
    """The names of every pdserve actor in ``namespace``, the router last. Uses the GCS's
    named-actor list, so it needs no dashboard."""
    import ray

    names = sorted(e["name"] for e in ray.util.list_named_actors(all_namespaces=True)
                   if e["namespace"] == namespace and e["name"].startswith("pdserve-"))
    # The router last: a `pdserve launch` in the foreground leaves (and stops the Ray cluster it
    # started) once its router is gone, so everything else must be done by then.
    names.sort(key=lambda n: n == ROUTER_NAME)
    return names


def kill_actors(names: list[str], namespace: str = NAMESPACE) -> list[str]:
    """Kill the named actors (gone ones are skipped); returns those killed."""
    import ray

    killed = []
    for name in names:
        try:
            ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
            killed.append(name)
        except ValueError:  # gone meanwhile
            pass
    return killed
