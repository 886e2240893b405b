"""A stand-in for AgentGym's WebArena server: same routes and reply shapes, a fake two-page site.

Run: ``python -m tests.integration.webarena_standin --port N``.  Task ``idx`` asks for the answer
``answer-<idx>``; ``stop [answer-<idx>]`` terminates with reward 1, any other stop with 0.  Like
the real server it extracts the action from a triple-back-tick block and answers errors as HTTP
200 with the message as the observation.  ``GET /log?env_idx=`` lists the raw actions received.
"""

from __future__ import annotations

import argparse
import re

from fastapi import FastAPI, Request

app = FastAPI()
STATE: dict[int, dict] = {}
NEXT = [0]


def page(idx: int, url: str, prev: str) -> str:
    return (f"OBJECTIVE: find answer for task {idx}\nURL: {url}\nOBSERVATION:\n[1] RootWebArea 'Home'\n"
            f"[12] link 'Answers'\n[31] textbox 'Search' required: False\nPREVIOUS ACTION: {prev}")


@app.get("/")
async def ok():
    return "ok"


@app.post("/create")
async def create():
    NEXT[0] += 1
    STATE[NEXT[0]] = {"idx": None, "url": "http://homepage.com", "log": []}
    return {"env_idx": NEXT[0]}


@app.post("/reset")
async def reset(request: Request):
    q = await request.json()
    s = STATE[q["env_idx"]]
    s.update(idx=q["idx"], url="http://homepage.com", seed=q["seed"])
    if q["idx"] == 13:
        return {"observation": "TimeoutError", "sites": "Error", "object": "Error"}
    return {"observation": page(q["idx"], s["url"], "None"), "sites": ["shopping", "reddit"], "object": f"task {q['idx']}"}


@app.post("/step")
async def step(request: Request):
    q = await request.json()
    s = STATE[q["env_idx"]]
    s["log"].append(q["action"])
    m = re.search(r"```((.|\n)*?)```", q["action"])
    if not m:
        return {"observation": f"Cannot parse action from response {q['action']}", "reward": 0,
                "terminated": False, "truncated": False, "info": None}
    action = m.group(1).strip()
    if action.startswith("stop"):
        right = action == f"stop [answer-{s['idx']}]"
        return {"observation": page(s["idx"], s["url"], action), "reward": 1.0 if right else 0.0,
                "terminated": True, "truncated": False, "info": {"page": "x"}}
    if action == "click [12]":
        s["url"] = "http://homepage.com/answers"
    return {"observation": page(s["idx"], s["url"], action), "reward": 0.0, "terminated": False,
            "truncated": False, "info": {"page": "x"}}


@app.post("/close")
async def close(request: Request):
    q = await request.json()
    STATE.pop(q["env_idx"], None)
    return {"closed": "closed"}


@app.get("/log")
async def log(env_idx: int):
    return STATE[env_idx]["log"] if env_idx in STATE else None


@app.get("/live")
async def live():
    return sorted(STATE)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=p.parse_args().port, log_level="warning")
