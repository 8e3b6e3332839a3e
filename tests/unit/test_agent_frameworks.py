"""Agents written with agent frameworks, run unchanged under a collector, offline: the OpenAI Agents SDK
(the Responses API and chat completions), LangGraph over langchain-openai's ``ChatOpenAI``, pydantic-ai
and smolagents. Each gets only the endpoint's base URL and its run's key from ``AgentContext`` (and
an HTTP client, for the in-process transport).

The scripted engine makes the tool calls happen (a Hermes ``<tool_call>``, then the answer): every
framework parses the call, runs its tool and sends the result back, and the next call's prompt
extends the recorded tokens. The tiny model checks token exactness over a real chat template across
two calls of one conversation. smolagents rewrites earlier messages (its tool calls and results
come back as text): those calls are rendered whole and counted (``stats.calls_rewritten``), as
docs/agents.md says. Nothing may reach the network: a guard refuses every address but loopback.
"""
from __future__ import annotations

import re
import socket

import pytest
import torch

from lmcollect.agents import AgentEnv, AgentServer
from lmcollect.data import History, keys
from lmcollect.envs import PromptDataset
from lmcollect.testing.scripted_engine import ByteTokenizer, ScriptedEngine, chat_script
from tests.unit.test_agents import collect, dialogs_of, text

FRAMEWORKS = ["openai-agents", "openai-agents-chat", "langgraph", "pydantic-ai", "smolagents"]
REWRITES = {"smolagents"}  # its memory sends earlier tool calls back as text ("Calling tools: ...")


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No framework may reach the internet (telemetry, tracing, price lists): only loopback resolves."""
    resolve = socket.getaddrinfo

    def loopback_only(host, *args, **kwargs):
        if host not in ("127.0.0.1", "localhost", "::1", None):
            raise OSError(f"the framework tests are offline: a connection to {host!r} was attempted")
        return resolve(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", loopback_only)
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
    monkeypatch.setenv("LANGSMITH_TRACING", "false")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)


@pytest.fixture(scope="module")
def server():
    with AgentServer() as shared:
        shared.start()
        yield shared


# ---------------------------------------------------------------------- the agents, as each framework's docs write them
def openai_agents_sdk(api: str):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)  # the SDK would send traces to OpenAI otherwise

    @agents.function_tool
    def add(a: int, b: int) -> str:
        """Add two numbers."""
        return str(a + b)

    async def agent(ctx, row):
        client = ctx.async_openai()  # openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
        model_class = agents.OpenAIResponsesModel if api == "responses" else agents.OpenAIChatCompletionsModel
        calculator = agents.Agent(name="calculator", instructions="Add with the add tool.", tools=[add],
                                  model=model_class(model=ctx.model, openai_client=client))
        result = await agents.Runner.run(calculator, row["prompt"])
        follow_up = result.to_input_list() + [{"role": "user", "content": "and then?"}]
        if "then" in row:  # a second run over the first one's conversation (the tiny model's check)
            await agents.Runner.run(calculator, follow_up)
        return score(result.final_output, row)

    return agent


def langgraph_agent():
    pytest.importorskip("langgraph")
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    @tool
    def add(a: int, b: int) -> str:
        """Add two numbers."""
        return str(a + b)

    def agent(ctx, row):
        llm = langchain_openai.ChatOpenAI(model=ctx.model, base_url=ctx.client_base_url, api_key=ctx.api_key,
                                          http_client=ctx.openai_http_client(), max_retries=0)
        graph = react_graph(llm.bind_tools([add]), ToolNode([add]), StateGraph(MessagesState), START, tools_condition)
        state = graph.invoke({"messages": [("user", row["prompt"])]})
        if "then" in row:
            graph.invoke({"messages": [*state["messages"], ("user", "and then?")]})
        return score(state["messages"][-1].content, row)

    return agent


def react_graph(model, tools, builder, start, tools_condition):
    """LangGraph's ReAct loop: the model, then its tool calls (if any) and the model again."""
    builder.add_node("model", lambda state: {"messages": [model.invoke(state["messages"])]})
    builder.add_node("tools", tools)
    builder.add_edge(start, "model")
    builder.add_conditional_edges("model", tools_condition)
    builder.add_edge("tools", "model")
    return builder.compile()


def pydantic_ai_agent():
    pydantic_ai = pytest.importorskip("pydantic_ai")
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    def add(a: int, b: int) -> str:
        """Add two numbers."""
        return str(a + b)

    async def agent(ctx, row):
        model = OpenAIChatModel(ctx.model, provider=OpenAIProvider(openai_client=ctx.async_openai()))
        calculator = pydantic_ai.Agent(model, tools=[add])
        result = await calculator.run(row["prompt"])
        if "then" in row:
            await calculator.run("and then?", message_history=result.all_messages())
        return score(result.output, row)

    return agent


def smolagents_agent():
    smolagents = pytest.importorskip("smolagents")
    from smolagents import tool

    @tool
    def add(a: int, b: int) -> str:
        """Add two numbers.

        Args:
            a: the first number
            b: the second number
        """
        return str(a + b)

    def agent(ctx, row):
        model = smolagents.OpenAIServerModel(model_id=ctx.model, api_base=ctx.client_base_url, api_key=ctx.api_key,
                                             client_kwargs={"http_client": ctx.openai_http_client(), "max_retries": 0})
        calculator = smolagents.ToolCallingAgent(tools=[add], model=model, max_steps=2, verbosity_level=0)
        answer = calculator.run(row["prompt"])
        if "then" in row:
            calculator.run("and then?", reset=False)
        return score(str(answer), row)

    return agent


def framework_agent(name: str):
    if name.startswith("openai-agents"):
        return openai_agents_sdk("chat" if name.endswith("chat") else "responses")
    return {"langgraph": langgraph_agent, "pydantic-ai": pydantic_ai_agent, "smolagents": smolagents_agent}[name]()


def score(answer: str, row) -> float:
    return float(answer.strip() in (f"ANSWER {row['answer']}", row["answer"]))


# ---------------------------------------------------------------------- the scripted model: a tool call, then the answer
def player(history: History) -> str:
    """An add call for the task's numbers; once the tool's result is back, the answer (smolagents ends with
    its ``final_answer`` tool, the result coming back as a user message ``Observation: ...``)."""
    task = next(m.content for m in history.messages if m.role == "user" and "add " in m.content)
    a, b = (int(x) for x in re.search(r"add (\d+) (\d+)", task).groups())
    last = history.messages[-1]
    if last.role == "tool":
        return f"ANSWER {last.content}"
    if last.role == "user" and last.content.startswith("Observation:"):
        result = last.content.removeprefix("Observation:").strip()
        return f'<tool_call>{{"name": "final_answer", "arguments": {{"answer": "{result}"}}}}</tool_call>'
    return f'<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'


def rows(n: int, **extra) -> PromptDataset:
    return PromptDataset([{"prompt": f"add {i} {i + 2}", "answer": str(2 * i + 2), **extra} for i in range(n)],
                         shuffle=False)


@pytest.mark.parametrize("transport", ["http", "in_process"])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_framework_agent_round_trips_its_tools_token_exact(framework, transport, server) -> None:
    env = AgentEnv(rows(4), framework_agent(framework), batch_size=2, repeats=2, seed=0, server=server,
                   transport=transport)
    engine = ScriptedEngine(script=chat_script(player))
    turns = collect(env, engine, batches=1, dialog_turns_per_batch=4)  # whole groups of whole runs
    engine.close()
    env.close()
    dialogs = list(dialogs_of(turns).values())
    assert len(dialogs) >= 2 and all(len(steps) == 2 for steps in dialogs)
    assert env.stats.runs_failed == 0 and env.stats.tool_parse_errors == 0
    for first, second in dialogs:
        call, answer = text(first, keys.TEXT_RESPONSE), text(second, keys.TEXT_RESPONSE)
        assert call.startswith('<tool_call>{"name": "add"') and [float(t[keys.NEXT_REWARD]) for t in (first, second)] == [0.0, 1.0]
        result = str(sum(int(x) for x in re.search(r"add (\d+) (\d+)", text(first, keys.TEXT_PROMPT)).groups()))
        assert result in answer  # the framework ran the tool and sent its result back
        prompt, recorded = second[keys.TOKENS_PROMPT], first[keys.TOKENS_FULL]
        if framework in REWRITES:  # rendered whole by the chat template: not the recorded tokens, and counted
            assert not torch.equal(prompt[: recorded.numel()], recorded)
            assert prompt.tolist() == ByteTokenizer().encode(text(second, keys.TEXT_PROMPT))
        else:  # the second call extends the first: its prompt starts with the tokens the first turn recorded
            assert torch.equal(prompt[: recorded.numel()], recorded)
    assert (env.stats.calls_rewritten >= 2) == (framework in REWRITES)
    assert env.stats.calls_rewritten == 0 or framework in REWRITES


# ---------------------------------------------------------------------- a real chat template: the tiny model
@pytest.mark.parametrize("framework", ["openai-agents-chat", "langgraph", "pydantic-ai", "smolagents"])
def test_a_framework_agent_records_token_exact_prompts_with_the_tiny_model(
    framework, server, tiny_model_and_tokenizer
) -> None:
    """Two runs over one conversation (the second continuing the first's messages): the second call's
    prompt starts with the first turn's tokens as generated (prefix mismatches flagged and counted)."""
    from lmcollect.collectors import ContinuousLLMCollector
    from lmcollect.data.turns import flatten_turns
    from lmcollect.engines import TransformersEngine
    from lmcollect.policies import SamplingConfig

    model, tokenizer = tiny_model_and_tokenizer
    agent = framework_agent(framework)
    env = AgentEnv(rows(4, then=True), agent, batch_size=2, seed=0, server=server, transport="in_process")
    with TransformersEngine(model, tokenizer) as engine:
        collector = ContinuousLLMCollector([env], engine=engine, tokenizer=tokenizer,
                                           sampling=SamplingConfig(max_new_tokens=12, min_new_tokens=2, temperature=1.0),
                                           dialog_turns_per_batch=4)
        with collector:
            turns = flatten_turns(collector.next())
            mismatches = collector.num_prefix_mismatches
    env.close()
    pairs = [steps for steps in dialogs_of(turns).values() if len(steps) == 2]
    assert pairs and env.stats.runs_failed == 0
    for first, second in pairs:
        prompt, recorded = second[keys.TOKENS_PROMPT], first[keys.TOKENS_FULL]
        retokenized = tokenizer(text(second, keys.TEXT_PROMPT), add_special_tokens=False)["input_ids"]
        if torch.equal(prompt[: recorded.numel()], recorded):  # extends the recorded tokens: a mismatch is flagged
            assert bool(second[keys.PREFIX_MISMATCH]) == (retokenized != prompt.tolist())
        else:  # smolagents rewrote the conversation (its second call: the task again, or its retry): rendered whole
            assert framework in REWRITES and prompt.tolist() == retokenized and not bool(second[keys.PREFIX_MISMATCH])
        if framework not in REWRITES:
            assert "and then?" in text(second, keys.TEXT_PROMPT)
    assert mismatches == sum(bool(t[keys.PREFIX_MISMATCH]) for t in turns)
    assert env.stats.calls_rewritten == 0 or framework in REWRITES
