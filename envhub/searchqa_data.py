"""A synthetic encyclopedia and QA set for SearchQA's default config and tests.

Invented people, cities, countries and companies, one short document each, in the
Search-R1/FlashRAG corpus layout (``{"id", "contents": "\\"Title\\"\\ntext"}``), and questions in
the FlashRAG QA layout (``{"id", "question", "golden_answers", "data_source", "gold_docs"}``):

* ``synth_1hop``: the answer is stated in the document titled with the question's entity
  ("Which city was X born in?");
* ``synth_2hop``: the answer needs a second document, named in the first ("In which country
  was X born?" = X's city, then that city's country).

Everything comes from ``random.Random(seed)``: the same seed gives byte-identical files on every
machine.  The shipped files under ``envhub/data/searchqa/`` were written by
``python -m turnscale.envhub.searchqa_data envhub/data/searchqa`` (a test checks they are current).
"""

from __future__ import annotations

import json
import os
import random
import sys
from dataclasses import dataclass

SEED = 20250901
N_COUNTRIES, N_CITIES, N_PEOPLE, N_COMPANIES = 60, 300, 1500, 400
N_QUESTIONS = 1000
DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "searchqa")
CORPUS_FILE, QUESTIONS_FILE = "corpus.jsonl", "questions.jsonl"

_ONSETS = ["b", "br", "c", "d", "dr", "f", "g", "gr", "h", "j", "k", "kl", "l", "m", "n", "p", "qu", "r",
           "s", "st", "t", "th", "tr", "v", "w", "z"]
_VOWELS = ["a", "e", "i", "o", "u", "ae", "ia", "ou"]
_CODAS = ["", "n", "r", "l", "s", "th", "m", "x", "nd", "rk"]
_PROFESSIONS = ["painter", "chemist", "poet", "architect", "astronomer", "composer", "botanist", "engineer",
                "historian", "sculptor", "cartographer", "physician"]
_INDUSTRIES = ["shipbuilding", "textiles", "optics", "printing", "brewing", "clockmaking", "glassware",
               "pharmaceuticals", "railways", "ceramics"]
_RIVERS = ["river", "lake", "bay", "delta", "harbour", "canyon"]


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables)).capitalize()


def _unique(rng: random.Random, n: int, make, taken: set[str]) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        w = make()
        if w not in taken:
            taken.add(w)
            out.append(w)
    return out


@dataclass(frozen=True)
class World:
    countries: list[str]
    capitals: dict[str, str]
    cities: list[str]
    city_country: dict[str, str]
    city_feature: dict[str, str]
    people: list[str]
    born_city: dict[str, str]
    born_year: dict[str, int]
    profession: dict[str, str]
    companies: list[str]
    founder: dict[str, str]
    hq: dict[str, str]
    industry: dict[str, str]
    founded: dict[str, int]


def make_world(seed: int = SEED) -> World:
    rng = random.Random(seed)
    taken: set[str] = set()
    countries = _unique(rng, N_COUNTRIES, lambda: _word(rng, 2) + "ia", taken)
    cities = _unique(rng, N_CITIES, lambda: _word(rng, rng.choice([2, 3])), taken)
    firsts = _unique(rng, 120, lambda: _word(rng, 2), taken)
    lasts = _unique(rng, 200, lambda: _word(rng, rng.choice([2, 3])), taken)
    people = _unique(rng, N_PEOPLE, lambda: f"{rng.choice(firsts)} {rng.choice(lasts)}", taken)
    companies = _unique(rng, N_COMPANIES, lambda: f"{_word(rng, 2)} {rng.choice(['Works', 'Company', 'Guild', 'Industries', 'Foundry'])}", taken)
    city_country = {c: countries[i % N_COUNTRIES] if i < N_COUNTRIES else rng.choice(countries) for i, c in enumerate(cities)}
    capitals = {k: cities[i] for i, k in enumerate(countries)}
    return World(
        countries=countries, capitals=capitals, cities=cities, city_country=city_country,
        city_feature={c: f"{rng.choice(_RIVERS)} of {_word(rng, 2)}" for c in cities},
        people=people, born_city={p: rng.choice(cities) for p in people},
        born_year={p: rng.randint(1700, 1990) for p in people},
        profession={p: rng.choice(_PROFESSIONS) for p in people},
        companies=companies, founder={c: rng.choice(people) for c in companies},
        hq={c: rng.choice(cities) for c in companies}, industry={c: rng.choice(_INDUSTRIES) for c in companies},
        founded={c: rng.randint(1750, 2010) for c in companies},
    )


def _docs(w: World) -> list[tuple[str, str]]:
    """(title, text) pairs; the doc id is the index."""
    docs: list[tuple[str, str]] = []
    for k in w.countries:
        n = sum(1 for c in w.cities if w.city_country[c] == k)
        docs.append((k, f"{k} is a country with {n} cities in this encyclopedia. Its capital is {w.capitals[k]}."))
    for c in w.cities:
        docs.append((c, f"{c} is a city in {w.city_country[c]}, known for its {w.city_feature[c]}."))
    for p in w.people:
        docs.append((p, f"{p} was a {w.profession[p]} born in {w.born_year[p]} in the city of {w.born_city[p]}."))
    for c in w.companies:
        docs.append((c, f"{c} is a {w.industry[c]} firm founded in {w.founded[c]} by {w.founder[c]}, with headquarters in {w.hq[c]}."))
    return docs


def _questions(w: World, doc_id: dict[str, int], rng: random.Random) -> list[dict]:
    def item(q: str, a: str, src: str, docs: list[str]) -> dict:
        return {"question": q, "golden_answers": [a], "data_source": src, "gold_docs": [str(doc_id[d]) for d in docs]}

    makers = [
        lambda: (p := rng.choice(w.people)) and item(f"Which city was {p} born in?", w.born_city[p], "synth_1hop", [p]),
        lambda: (p := rng.choice(w.people)) and item(f"What was the profession of {p}?", w.profession[p], "synth_1hop", [p]),
        lambda: (c := rng.choice(w.companies)) and item(f"Who founded {c}?", w.founder[c], "synth_1hop", [c]),
        lambda: (c := rng.choice(w.cities)) and item(f"In which country is the city of {c}?", w.city_country[c], "synth_1hop", [c]),
        lambda: (p := rng.choice(w.people)) and item(
            f"In which country was {p} born?", w.city_country[w.born_city[p]], "synth_2hop", [p, w.born_city[p]]),
        lambda: (c := rng.choice(w.companies)) and item(
            f"In which city was the founder of {c} born?", w.born_city[w.founder[c]], "synth_2hop", [c, w.founder[c]]),
        lambda: (c := rng.choice(w.companies)) and item(
            f"In which country does {c} have its headquarters?", w.city_country[w.hq[c]], "synth_2hop", [c, w.hq[c]]),
    ]
    out: list[dict] = []
    seen: set[str] = set()
    while len(out) < N_QUESTIONS:
        q = rng.choice(makers)()
        if q["question"] not in seen:
            seen.add(q["question"])
            out.append({"id": f"synth-{len(out)}", **q})
    return out


def generate(seed: int = SEED) -> tuple[list[dict], list[dict]]:
    """(corpus records, question records), deterministic in ``seed``."""
    w = make_world(seed)
    docs = _docs(w)
    corpus = [{"id": str(i), "contents": f'"{t}"\n{x}'} for i, (t, x) in enumerate(docs)]
    doc_id = {t: i for i, (t, _) in enumerate(docs)}
    return corpus, _questions(w, doc_id, random.Random(seed + 1))


def _dump(records: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in records)


def write(out_dir: str, seed: int = SEED) -> tuple[str, str]:
    corpus, questions = generate(seed)
    os.makedirs(out_dir, exist_ok=True)
    paths = os.path.join(out_dir, CORPUS_FILE), os.path.join(out_dir, QUESTIONS_FILE)
    for path, recs in zip(paths, (corpus, questions)):
        with open(path, "w", encoding="utf-8", newline="\n") as f:
            f.write(_dump(recs))
    return paths


if __name__ == "__main__":
    print(write(sys.argv[1] if len(sys.argv) > 1 else DATA_DIR))
