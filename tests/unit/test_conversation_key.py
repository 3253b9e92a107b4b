"""Which conversation a request continues (dflash/protocols/conversation.py)."""

from dflash.protocols.conversation import MAX_KEY_CHARS, conversation_key

CLAUDE_CODE_USER_ID = "user_4f1c_account_9a2e_session_0b6d2c1e-7d7a-4a53-9d8e-2f0c5b1f9a11"


def test_the_most_specific_id_the_client_sent():
    assert conversation_key(session_header="codex-session", prompt_cache_key="codex-conv") == "codex-conv"
    assert conversation_key(session_header="codex-session") == "codex-session"
    assert conversation_key(metadata={"user_id": CLAUDE_CODE_USER_ID}) == CLAUDE_CODE_USER_ID


def test_no_id_and_odd_ones():
    assert conversation_key() is None
    assert conversation_key(metadata={"user_id": 42, "user": "alice"}) is None  # `user` names a person
    assert len(conversation_key(session_header="x" * 1000)) == MAX_KEY_CHARS
