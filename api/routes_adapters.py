"""The adapters: GET /v1/adapters (the console's table) and the admin endpoints
POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's bodies and answers)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse

from loraplex.api import openai_format as fmt
from loraplex.api.auth import require_admin, require_user
from loraplex.api.protocol import LoadAdapterRequest, UnloadAdapterRequest
from loraplex.api.state import ServerState, state_of

router = APIRouter()


@router.get("/v1/adapters", dependencies=[Depends(require_user)])
async def adapters(state: ServerState = Depends(state_of)):
    """loraplex's own: each registered adapter with its shape, where it is now, and what it
    served (the console's adapters view)."""
    status = state.client.adapter_status()
    return fmt.adapter_list(await state.adapters.infos(), status, state.metrics.by_adapter)


@router.post("/v1/load_lora_adapter", dependencies=[Depends(require_admin)])
async def load_lora_adapter(body: LoadAdapterRequest, state: ServerState = Depends(state_of)):
    await state.adapters.load(body.lora_name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", dependencies=[Depends(require_admin)])
async def unload_lora_adapter(body: UnloadAdapterRequest, state: ServerState = Depends(state_of)):
    await state.adapters.unload(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
