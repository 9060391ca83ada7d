import subprocess
import sys

from loraplex.api.cli import main


def test_generate_with_chat_template(tiny_model_dir, tiny_llm, capsys):
    from loraplex.platform import SamplingParams

    assert main(["generate", "hello world", "--model", str(tiny_model_dir), "--max-tokens", "4", "--chat"]) == 0
    prompt = tiny_llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "hello world"}],
                                                          tokenize=False, add_generation_prompt=True)
    text = tiny_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].text
    assert capsys.readouterr().out == text + "\n"


def test_generate_matches_the_offline_api(tiny_model_dir, tiny_llm, capsys):
    from loraplex.platform import SamplingParams

    main(["generate", "hello world", "--model", str(tiny_model_dir), "--max-tokens", "6", "--dtype", "float32"])
    text = tiny_llm.generate(["hello world"], SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].text
    assert capsys.readouterr().out == text + "\n"


def test_bad_input_is_an_error_not_a_traceback(tiny_model_dir, capsys):
    assert main(["generate", "hi", "--model", str(tiny_model_dir), "--max-tokens", "0"]) == 2
    assert "max_tokens" in capsys.readouterr().err


def test_default_model_command_prints_the_folder(default_model_dir):
    out = subprocess.run([sys.executable, "-m", "loraplex.api.cli", "default-model"], capture_output=True,
                         text=True, check=True, timeout=300)
    assert out.stdout.strip() == str(default_model_dir)
