"""The API talks to the engine through AsyncEngine's facade (inputs, adapters, generate_many,
stats), never through its internals."""

from pathlib import Path

API = Path(__file__).resolve().parents[2] / "api"


def test_the_api_never_reaches_into_the_engine():
    for module in API.glob("*.py"):
        text = module.read_text()
        for internal in ("engine.engine", ".scheduler.", ".kv.", ".runner."):
            assert internal not in text, f"{module.name} uses {internal!r}"
