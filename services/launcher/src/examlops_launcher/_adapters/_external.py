"""external: servers someone else runs. Starts nothing; the addresses are given (one per replica)."""

from __future__ import annotations

from collections.abc import Sequence

from examlops.launcher.v1 import launcher_pb2 as pb
from examlops.registry.v1 import registry_pb2 as reg

from ._base import Adapter, LaunchSpec, Prepared, Submission, SubstrateView, render

SOURCE = "external"


class ExternalAdapter(Adapter):
    name = "external"

    def plan(self, spec: LaunchSpec) -> Prepared:
        where = ", ".join(spec.base_urls) or "(no address: engine-proxy answers)"
        pool = f" ({len(spec.base_urls)} replicas)" if len(spec.base_urls) > 1 else ""
        plan = pb.LaunchPlan(launcher=self.name, summary=(
            f"register endpoint {spec.name!r} at {where}{pool}; the external launcher starts nothing"))
        if spec.block is not None and spec.block.engine == "vllm-server" and spec.block.hf_model_id:
            # For the operator's information: how the server at that address is expected to run.
            # The key's value is not needed to show the argv (it never is on the argv).
            var = spec.block.api_key_env_var
            command = render(spec, host=None, port=None, environ={var: "***"} if var else {})
            plan.argv.extend(command.argv)
        return Prepared(plan=plan)

    async def start(self, spec: LaunchSpec, prepared: Prepared) -> list[Submission]:
        urls = spec.base_urls or ("",)
        return [Submission(replica_id=rid, source=SOURCE, job_id="", base_url=url, state=reg.ENDPOINT_STATE_STARTING,
                           reason="registered; the external launcher starts nothing")
                for rid, url in zip(spec.replica_ids, urls, strict=True)]

    async def status(self, ep: reg.Endpoint, replica: reg.Replica) -> SubstrateView:
        return SubstrateView(fields={"launcher": "external", "managed_by": "someone else (nothing started here)"})

    def stop_plan(self, ep: reg.Endpoint, replicas: Sequence[reg.Replica]) -> pb.LaunchPlan:
        return pb.LaunchPlan(launcher=self.name, summary=(
            f"mark endpoint {ep.name!r} STOPPED; the server itself is not ours to stop"))

    async def stop(self, ep: reg.Endpoint, replica: reg.Replica) -> str:
        return "stopped by operator"

    async def stop_all(self, ep: reg.Endpoint) -> str:
        return "stopped by operator"
