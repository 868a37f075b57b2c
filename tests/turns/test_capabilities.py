"""Operators narrow what an agent offers: history types and stream modes it does not
declare are refused the way the spec says (404 for history, 400 for a stream mode)."""


def _info(client, name):
    return next(a for a in client.meta()["agents"] if a["name"] == name)


def test_meta_shows_only_the_history_and_stream_modes_the_operator_left_on(demo):
    caps = _info(demo, "echo-narrow")["capabilities"]
    assert caps["history"] == {"full": {}}
    assert caps["stream"] == {"none": {}}
    assert _info(demo, "echo")["capabilities"]["stream"] == {"delta": {}, "message": {}, "none": {}}


def test_history_type_the_agent_does_not_declare_is_404(demo):
    session = demo.create_session("echo-narrow")
    assert demo.turn(session, text="hi").stop_reason == "end_turn"
    response = demo.get(f"/v1/sessions/{session}/history", params={"type": "compacted"})
    assert response.status_code == 404
    assert "compacted" in response.json()["error"]
    assert demo.history(session, "full")[-1]["content"][0]["text"] == "echo: hi"


def test_stream_mode_the_agent_does_not_support_is_400_and_stores_nothing(demo):
    session = demo.create_session("echo-narrow")
    result = demo.turn(session, text="hi", stream="delta")
    assert result.status == 400
    assert "delta" in result.body["error"]
    assert demo.history(session, "full") == []
    assert demo.turn(session, text="again").messages[0]["content"][0]["text"] == "echo: again"
