"""Secret redaction: every credential shape hidden, ordinary training-log text left exactly as it was."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prime_train.config.loader import MASK
from prime_train.config.schema import Config
from prime_train.kit.events import EventLog, read_events
from prime_train.kit.redact import (
    REDACTED,
    Redactor,
    is_secret_name,
    looks_secret_name,
    redact,
    redact_argv,
    redact_env,
)

HF = "hf_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789"
WANDB = "0123456789abcdef0123456789abcdef01234567"
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"

# (line, the secret in it, text around it that must survive)
SECRETS = [
    (f"HF_TOKEN={HF} python train.py", HF, "python train.py"),
    (f"using token {HF} from the cache", HF, "from the cache"),
    ("export OPENAI_API_KEY=sk-proj-Ab12Cd34Ef56Gh78Ij90Kl12Mn34", "sk-proj-Ab12Cd34Ef56Gh78Ij90Kl12Mn34", "export"),
    ("client = OpenAI(api_key='sk-Ab12Cd34Ef56Gh78Ij90Kl12')", "sk-Ab12Cd34Ef56Gh78Ij90Kl12", "client = OpenAI("),
    ("key sk-ant-api03-Ab12Cd34Ef56Gh78Ij90-Kl12Mn34 used", "sk-ant-api03-Ab12Cd34Ef56Gh78Ij90-Kl12Mn34", "used"),
    (f"WANDB_API_KEY={WANDB}", WANDB, "WANDB_API_KEY="),
    (f"$ wandb login --relogin {WANDB}", WANDB, "wandb login --relogin"),
    (f"wandb login --host https://api.wandb.ai {WANDB}", WANDB, "https://api.wandb.ai"),
    ("aws_access_key_id = AKIAIOSFODNN7EXAMPLE", "AKIAIOSFODNN7EXAMPLE", "aws_access_key_id = "),
    ("session ASIAY34FZKBOKMUTVV7A expires", "ASIAY34FZKBOKMUTVV7A", "expires"),
    (f"aws_secret_access_key = {AWS_SECRET}", AWS_SECRET, "aws_secret_access_key = "),
    (f"AWS_SECRET_ACCESS_KEY={AWS_SECRET} aws s3 ls", AWS_SECRET, "aws s3 ls"),
    ("push with ghp_Ab12Cd34Ef56Gh78Ij90Kl12Mn34Op56Qr78", "ghp_Ab12Cd34Ef56Gh78Ij90Kl12Mn34Op56Qr78", "push with"),
    ("GITHUB_TOKEN=ghs_Ab12Cd34Ef56Gh78Ij90Kl12Mn34Op56Qr78", "ghs_Ab12Cd34Ef56Gh78Ij90Kl12Mn34Op56Qr78", "GITHUB"),
    ("token gho_Ab12Cd34Ef56Gh78Ij90Kl12Mn34Op56Qr78 ok", "gho_Ab12Cd34Ef56Gh78Ij90Kl12Mn34Op56Qr78", "ok"),
    (
        "pat github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyz",
        "github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyz",
        "pat",
    ),
    (
        "Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.e30.ZRrHA1JJJW8opsbCGfG",
        "eyJhbGciOiJIUzI1NiJ9.e30.ZRrHA1JJJW8opsbCGfG",
        "Authorization: Bearer",
    ),
    ("headers={'Authorization': 'Basic dXNlcjpwYXNzd29yZA=='}", "dXNlcjpwYXNzd29yZA==", "headers="),
    ('{"api_key": "my-internal-key-42", "model": "qwen"}', "my-internal-key-42", '"model": "qwen"'),
    ("{'hf_token': 'abc123def456', 'max_tokens': 256}", "abc123def456", "'max_tokens': 256"),
    ("db_password=hunter2 user=bob", "hunter2", "user=bob"),
    ("MLFLOW_TRACKING_PASSWORD: s3cr3t!", "s3cr3t!", "MLFLOW_TRACKING_PASSWORD"),
    ("client_secret = 'abcDEF123'", "abcDEF123", "client_secret"),
    ("vllm serve Qwen/Qwen3-8B --api-key local-key-123 --port 8000", "local-key-123", "--port 8000"),
    ("python train.py --hub-token=abcdefgh12345678", "abcdefgh12345678", "python train.py"),
    ("GET https://host/metrics?access_token=abcdef123456&window=5m", "abcdef123456", "&window=5m"),
    (
        "git clone https://oauth2:glpat-abc123XYZ@gitlab.com/acme/repo.git",
        "glpat-abc123XYZ",
        "@gitlab.com/acme/repo.git",
    ),
    ("accessToken: 'xyz-123-abc'", "xyz-123-abc", "accessToken"),
    # a W&B key has no shape of its own: 40 hex digits, secret on a line that is about W&B
    (f"wandb_key: {WANDB} (from ~/.netrc)", WANDB, "(from ~/.netrc)"),
    (f"python train.py --wandb-key {WANDB} --steps 10", WANDB, "--steps 10"),
    (f"wandb: logging in with {WANDB.upper()}", WANDB.upper(), "wandb: logging in with"),
]

ORDINARY = [
    "12:00:01 INFO step 120/300 | loss 2.3456 | lr 3.00e-03 | grad 0.812 | 41.2k tok/s | eta 120s",
    "prime-train 0.1.0 (git 3f2a9c1e5b7d4f6a8c0e2b4d6f8a0c2e4b6d8f0a)",
    "commit 3f2a9c1e5b7d4f6a8c0e2b4d6f8a0c2e4b6d8f0a: fix resume",
    "/root/.cache/huggingface/hub/models--Qwen--Qwen2.5-0.5B/snapshots/7ae557604adf67be50417f59c2c2f167def9a775/config.json",
    "config: max_tokens=256 num_tokens: 1000 tokens_per_s=1234.5 token_count=88",
    "tokenizer: Qwen/Qwen2.5-0.5B-Instruct pad_token=<|endoftext|> pad_token_id=151643 eos_token: <|im_end|>",
    "TOKENIZERS_PARALLELISM=false HF_HUB_ENABLE_HF_TRANSFER=1",
    "HF_TOKEN=None HF_TOKEN: present WANDB_API_KEY=$WANDB_API_KEY",
    "use_auth_token=True, trust_remote_code=False",
    "eval_loss 2.1034 | eval_exact_match 0.1250 | loss_scale 1.0",
    "hf_hub_download(repo_id='Qwen/Qwen2.5-0.5B', filename='model.safetensors')",
    "scikit-learn: sk-learn shim, task-specific-adapter-0123456789abcdefghij, disk-usage-0123456789012345678901",
    "wandb: ⭐️ View project at https://wandb.ai/acme/prime-train",
    "Use `wandb login --relogin` to force relogin",
    "(APIServer pid=1) INFO 11-21 09:05:11 [kv_cache_utils.py:1087] GPU KV cache size: 979,456 tokens",
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
    "checkpoint saved to s3://bucket/runs/tiny/checkpoints/step-100",
    "NCCL INFO comm 0x55d0c4a1e2f0 rank 0 nranks 2 cudaDev 0 busId 18000 commId 0x8f3a2b1c4d5e6f70 - Init COMPLETE",
    "keys: ['model.embed_tokens.weight', 'lm_head.weight'] missing_keys=[] unexpected_keys=[]",
    "",
]


@pytest.mark.parametrize(("line", "secret", "kept"), SECRETS)
def test_secret_is_replaced_and_the_rest_of_the_line_kept(line, secret, kept):
    out = redact(line)
    assert secret not in out
    assert REDACTED in out
    assert kept in out


@pytest.mark.parametrize("line", ORDINARY)
def test_ordinary_log_line_is_left_unchanged(line):
    assert redact(line) == line


@pytest.mark.parametrize("line", [s for s, _, _ in SECRETS])
def test_redacting_twice_changes_nothing_more(line):
    once = redact(line)
    assert redact(once) == once


@given(
    step=st.integers(0, 10**7),
    loss=st.floats(0, 20, allow_nan=False),
    lr=st.floats(1e-8, 1, allow_nan=False),
    commit=st.text("0123456789abcdef", min_size=7, max_size=40),
    path=st.lists(st.text("abcdefghijklmnopqrstuvwxyz0123456789_-.", min_size=1, max_size=12), min_size=1, max_size=6),
)
def test_generated_training_log_lines_are_never_changed(step, loss, lr, commit, path):
    line = (
        f"12:00:01 INFO step {step}/{step + 1} | loss {loss:.4f} | lr {lr:.2e} | "
        f"num_tokens={step} | saved /{'/'.join(path)}/step-{step} (git {commit})"
    )
    assert redact(line) == line


@given(st.text(max_size=200))
def test_redaction_is_idempotent_on_any_text(text):
    once = redact(text)
    assert redact(once) == once


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("HF_TOKEN", True),
        ("HUGGING_FACE_HUB_TOKEN", True),
        ("WANDB_API_KEY", True),
        ("OPENAI_API_KEY", True),
        ("AWS_SECRET_ACCESS_KEY", True),
        ("AWS_SESSION_TOKEN", True),
        ("GITHUB_TOKEN", True),
        ("DB_PASSWORD", True),
        ("accessToken", True),
        ("hub_token", True),
        ("TOKENIZERS_PARALLELISM", False),
        ("max_tokens", False),
        ("num_tokens", False),
        ("tokenizer", False),
        ("pad_token", False),
        ("eos_token_id", False),
        ("token_count", False),
        ("SSH_AUTH_SOCK", False),
        ("PATH", False),
    ],
)
def test_secret_names_are_told_from_token_counts_and_vocabulary(name, secret):
    assert is_secret_name(name) is secret


def test_redact_env_hides_credentials_and_keeps_the_rest():
    env = {
        "HF_TOKEN": HF,
        "WANDB_API_KEY": WANDB,
        "AWS_ACCESS_KEY_ID": "AKIAIOSFODNN7EXAMPLE",
        "DATABASE_URL": "postgres://trainer:pa55word@db:5432/runs",
        "TOKENIZERS_PARALLELISM": "false",
        "PATH": "/root/venv/bin:/usr/bin",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "EMPTY_TOKEN": "",
    }
    before = dict(env)
    out = redact_env(env)
    assert env == before  # a copy, the caller's dict untouched
    assert out["HF_TOKEN"] == out["WANDB_API_KEY"] == out["AWS_ACCESS_KEY_ID"] == REDACTED
    assert out["DATABASE_URL"] == f"postgres://trainer:{REDACTED}@db:5432/runs"
    assert out["EMPTY_TOKEN"] == ""  # says "unset", which is what a reader needs to know
    for key in ("TOKENIZERS_PARALLELISM", "PATH", "CUDA_VISIBLE_DEVICES"):
        assert out[key] == env[key]


def test_redact_argv_hides_a_secret_flag_value_given_as_its_own_item():
    argv = ["vllm", "serve", "Qwen/Qwen3-8B", "--api-key", "local-key-123", "--port", "8000", f"--hf-token={HF}"]
    assert redact_argv(argv) == [
        "vllm",
        "serve",
        "Qwen/Qwen3-8B",
        "--api-key",
        REDACTED,
        "--port",
        "8000",
        f"--hf-token={REDACTED}",
    ]
    assert redact_argv(["train.py", "--max-tokens", "256", "--tokenizer", "gpt2"]) == [
        "train.py",
        "--max-tokens",
        "256",
        "--tokenizer",
        "gpt2",
    ]
    assert redact_argv(["--api-key", "--port", "8000"]) == ["--api-key", "--port", "8000"]


def test_events_written_through_the_event_log_are_redacted(tmp_path):
    log = EventLog(tmp_path / "events.jsonl")
    log.emit(
        "log_finding", text=f"torch.OutOfMemoryError (HF_TOKEN={HF})", extra={"cmd": f"wandb login {WANDB}"}, line=3
    )
    (event,) = read_events(tmp_path / "events.jsonl")
    assert HF not in str(event) and WANDB not in str(event)
    assert event["line"] == 3 and event["text"].startswith("torch.OutOfMemoryError")


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("WANDB_KEY", True),
        ("wandb_key", True),
        ("DB_PASS", True),
        ("MYSQL_PWD", True),
        ("SMTP_AUTH", True),
        ("GOOGLE_APPLICATION_CREDENTIALS", True),
        ("SSH_PRIVATE_PEM", True),
        ("client-secret", True),
        ("apiKey", True),
        ("HF_TOKEN", True),
        ("PWD", False),  # the shell's working directory
        ("OLDPWD", False),
        ("SSH_AUTH_SOCK", False),  # a socket path
        ("PUBLIC_KEY", False),
        ("KEYBOARD", False),
        ("PRIVATE", False),  # alone: `--private` is a switch
        ("max_tokens", False),
        ("TOKENIZERS_PARALLELISM", False),
        ("required_env", False),
    ],
)
def test_names_chosen_for_a_value_are_secret_by_any_credential_word(name, secret):
    assert looks_secret_name(name) is secret


def test_redact_argv_hides_values_of_flags_named_like_any_credential():
    argv = ["train.py", "--wandb_key", WANDB, "--db-pass=hunter2-long", "--no-auth", "data/", "--private", "out/"]
    assert redact_argv(argv) == [
        "train.py", "--wandb_key", REDACTED, f"--db-pass={REDACTED}", "--no-auth", "data/", "--private", "out/",
    ]  # fmt: skip


def test_redactor_masks_values_of_credential_variables_wherever_they_appear():
    env = {
        "ANALYTICS_PASS": "plain-analytics-42",
        "PRIVATE_PEM": "-----BEGIN KEY-----\nAAAAsecretline\n-----END KEY-----",
    }
    redactor = Redactor.from_environment(env)
    assert redactor("sent plain-analytics-42 to the server") == f"sent {REDACTED} to the server"
    assert redactor("AAAAsecretline") == REDACTED  # a multi-line key reaches logs line by line
    assert redactor.value({"a": ["x plain-analytics-42"], "n": 3}) == {"a": [f"x {REDACTED}"], "n": 3}


@pytest.mark.parametrize("value", ["", "none", "true", "12345", "3.5e-4", "abc", "$HF_TOKEN", "***"])
def test_redactor_leaves_values_that_cannot_be_credentials_alone(value):
    redactor = Redactor.from_environment({"SOME_TOKEN": value, "OTHER_KEY": value})
    assert redactor.values == ()
    line = f"step 12345 lr 3.5e-4 abc {value} true none"
    assert redactor(line) == redact(line)


def test_masked_config_hides_secret_values_and_keeps_names_and_ordinary_text():
    cfg = Config.model_validate(
        {
            "job": {
                "command": ["python", "t.py", "--wandb_key", WANDB, f"--hf-token={HF}", "--lr", "3e-4"],
                "env": {"DB_PASSWORD": "hunter2-long", "MODE": "fast-and-loose"},
            },
            "spot": {"setup": [f"export HF_TOKEN={HF}"], "secrets": ["WANDB_API_KEY", "HF_TOKEN"]},
            "rl": {"env_args": {"api_key": "judge-key-123", "rounds": 3}},
        }
    )
    masked = Redactor.for_run(cfg, {}).masked_config(cfg)
    for secret in (WANDB, HF, "hunter2-long", "judge-key-123"):
        assert secret not in masked.text
    assert f'"--wandb_key",\n    "{MASK}",\n    "--hf-token={MASK}",' in masked.text
    assert 'MODE = "fast-and-loose"' in masked.text and f'DB_PASSWORD = "{MASK}"' in masked.text
    assert f'"export HF_TOKEN={MASK}"' in masked.text
    assert '"WANDB_API_KEY",' in masked.text  # the names of secrets are not secret
    assert sorted(path for path, _ in masked.secrets) == sorted(
        [["job", "command", 3], ["job", "command", 4], ["job", "env", "DB_PASSWORD"], ["spot", "setup", 0],
         ["rl", "env_args", "api_key"]]
    )  # fmt: skip


def test_event_log_masks_by_value_with_the_runs_redactor(tmp_path):
    log = EventLog(tmp_path / "events.jsonl", Redactor(["plain-analytics-42"]))
    log.emit("failure", evidence=["login plain-analytics-42", f"token {HF}"], step=4)
    (event,) = read_events(tmp_path / "events.jsonl")
    assert event["evidence"] == [f"login {REDACTED}", f"token {REDACTED}"] and event["step"] == 4
