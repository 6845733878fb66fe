"""Write the three example team eval sets under evals/ (deterministic, no downloads).

Run: python scripts/make_example_evals.py   (rewrites evals/*/data.jsonl)

The data are written by the repo so that a fresh clone needs nothing from a hub:
- search:  capital-city multiple choice (knowledge), 4 choices, target = index.
- billing: short arithmetic questions answered in free text, exact match on the number.
- support: customer-message sentiment, 2-way classification scored by loglikelihood.
"""

import argparse
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "evals"
# questions drawn; the repeats among them are left out (289 distinct stay), since lm-eval would score a
# repeated question twice, as two pieces of evidence; 289 are enough for an equally good build to PASS at
# 8 points (benchmarks/README.md "Example sets")
BILLING_DRAWS = 400

CAPITALS = [
    ("France", "Paris"),
    ("Germany", "Berlin"),
    ("Italy", "Rome"),
    ("Spain", "Madrid"),
    ("Portugal", "Lisbon"),
    ("United Kingdom", "London"),
    ("Ireland", "Dublin"),
    ("Netherlands", "Amsterdam"),
    ("Belgium", "Brussels"),
    ("Austria", "Vienna"),
    ("Switzerland", "Bern"),
    ("Poland", "Warsaw"),
    ("Czech Republic", "Prague"),
    ("Hungary", "Budapest"),
    ("Greece", "Athens"),
    ("Sweden", "Stockholm"),
    ("Norway", "Oslo"),
    ("Denmark", "Copenhagen"),
    ("Finland", "Helsinki"),
    ("Iceland", "Reykjavik"),
    ("Russia", "Moscow"),
    ("Ukraine", "Kyiv"),
    ("Romania", "Bucharest"),
    ("Bulgaria", "Sofia"),
    ("Serbia", "Belgrade"),
    ("Croatia", "Zagreb"),
    ("Slovakia", "Bratislava"),
    ("Slovenia", "Ljubljana"),
    ("Estonia", "Tallinn"),
    ("Latvia", "Riga"),
    ("Lithuania", "Vilnius"),
    ("Turkey", "Ankara"),
    ("Egypt", "Cairo"),
    ("Morocco", "Rabat"),
    ("Kenya", "Nairobi"),
    ("Nigeria", "Abuja"),
    ("Ethiopia", "Addis Ababa"),
    ("Ghana", "Accra"),
    ("South Africa", "Pretoria"),
    ("Algeria", "Algiers"),
    ("Tunisia", "Tunis"),
    ("Senegal", "Dakar"),
    ("Uganda", "Kampala"),
    ("Tanzania", "Dodoma"),
    ("Zimbabwe", "Harare"),
    ("Angola", "Luanda"),
    ("Sudan", "Khartoum"),
    ("Libya", "Tripoli"),
    ("Japan", "Tokyo"),
    ("China", "Beijing"),
    ("South Korea", "Seoul"),
    ("North Korea", "Pyongyang"),
    ("India", "New Delhi"),
    ("Pakistan", "Islamabad"),
    ("Bangladesh", "Dhaka"),
    ("Nepal", "Kathmandu"),
    ("Sri Lanka", "Colombo"),
    ("Thailand", "Bangkok"),
    ("Vietnam", "Hanoi"),
    ("Cambodia", "Phnom Penh"),
    ("Laos", "Vientiane"),
    ("Malaysia", "Kuala Lumpur"),
    ("Singapore", "Singapore"),
    ("Indonesia", "Jakarta"),
    ("Philippines", "Manila"),
    ("Mongolia", "Ulaanbaatar"),
    ("Afghanistan", "Kabul"),
    ("Iran", "Tehran"),
    ("Iraq", "Baghdad"),
    ("Syria", "Damascus"),
    ("Lebanon", "Beirut"),
    ("Jordan", "Amman"),
    ("Saudi Arabia", "Riyadh"),
    ("Qatar", "Doha"),
    ("Kuwait", "Kuwait City"),
    ("Oman", "Muscat"),
    ("Yemen", "Sanaa"),
    ("Israel", "Jerusalem"),
    ("Kazakhstan", "Astana"),
    ("Uzbekistan", "Tashkent"),
    ("United States", "Washington, D.C."),
    ("Canada", "Ottawa"),
    ("Mexico", "Mexico City"),
    ("Cuba", "Havana"),
    ("Jamaica", "Kingston"),
    ("Guatemala", "Guatemala City"),
    ("Panama", "Panama City"),
    ("Costa Rica", "San Jose"),
    ("Colombia", "Bogota"),
    ("Venezuela", "Caracas"),
    ("Ecuador", "Quito"),
    ("Peru", "Lima"),
    ("Bolivia", "Sucre"),
    ("Chile", "Santiago"),
    ("Argentina", "Buenos Aires"),
    ("Uruguay", "Montevideo"),
    ("Paraguay", "Asuncion"),
    ("Brazil", "Brasilia"),
    ("Australia", "Canberra"),
    ("New Zealand", "Wellington"),
    ("Fiji", "Suva"),
    ("Papua New Guinea", "Port Moresby"),
    ("Luxembourg", "Luxembourg"),
    ("Malta", "Valletta"),
    ("Cyprus", "Nicosia"),
    ("Albania", "Tirana"),
    ("Georgia", "Tbilisi"),
    ("Armenia", "Yerevan"),
    ("Azerbaijan", "Baku"),
]

PRODUCTS = [
    "headphones",
    "vacuum cleaner",
    "office chair",
    "printer",
    "sofa",
    "smart watch",
    "kettle",
    "suitcase",
    "blender",
    "backpack",
    "phone case",
    "desk lamp",
    "coffee maker",
    "running shoes",
    "keyboard",
    "water bottle",
    "tent",
    "monitor",
    "jacket",
]
POSITIVE = [
    "works perfectly and I love it",
    "arrived early and the quality is excellent",
    "is the best purchase I made this year",
    "exceeded my expectations, thank you",
    "is great value and my whole family enjoys it",
    "was delivered on time and setup took two minutes",
    "feels sturdy and looks even better than the photos",
    "solved my problem and the support team was very kind",
]
NEGATIVE = [
    "broke after two days and I want a refund",
    "arrived damaged and support never replied",
    "is the worst purchase I have ever made",
    "stopped working and I am very disappointed",
    "is cheaply made and a complete waste of money",
    "never arrived and nobody answers my emails",
    "leaks everywhere and the replacement is broken too",
    "was charged twice and I still have no answer",
]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def choice_row(rng: random.Random, id_: str, question: str, right: str, pool: list[str]) -> dict:
    """A 4-way multiple-choice document: `right` and 3 others drawn from `pool`, shuffled."""
    choices = rng.sample([c for c in pool if c != right], 3) + [right]
    rng.shuffle(choices)
    return {"id": id_, "question": question, "choices": choices, "answer": choices.index(right)}


def search_rows(rng: random.Random) -> list[dict]:
    cities = sorted({c for _, c in CAPITALS})
    rows = [
        choice_row(rng, f"cap-{i:03d}", f"What is the capital of {country}?", capital, cities)
        for i, (country, capital) in enumerate(CAPITALS)
    ]
    countries = sorted({c for c, _ in CAPITALS})
    rows += [
        choice_row(rng, f"country-{i:03d}", f"{capital} is the capital of which country?", country, countries)
        for i, (country, capital) in enumerate(CAPITALS)
        if capital != country  # "Singapore is the capital of which country?" answers itself
    ]
    return rows


def billing_rows(rng: random.Random) -> list[dict]:
    rows, seen = [], set()
    for i in range(BILLING_DRAWS):
        a, b = (rng.randint(1, 9), rng.randint(1, 9)) if i % 2 else (rng.randint(10, 60), rng.randint(1, 30))
        op = "+" if i % 3 else "-"
        if op == "-" and b > a:
            a, b = b, a
        result = a + b if op == "+" else a - b
        if (question := f"What is {a} {op} {b}?") not in seen:
            seen.add(question)
            rows.append({"id": f"arith-{i:03d}", "question": question, "answer": str(result)})
    return rows


def support_rows(rng: random.Random) -> list[dict]:
    rows = []
    for i, product in enumerate(PRODUCTS):
        for j, phrase in enumerate(POSITIVE + NEGATIVE):
            label = 0 if j < len(POSITIVE) else 1
            rows.append({"id": f"msg-{i:02d}-{j}", "message": f"The {product} I ordered {phrase}.", "label": label})
    rng.shuffle(rows)
    return rows


def main() -> None:
    # no options: argparse answers --help and refuses anything else (both rewrote evals/ before)
    argparse.ArgumentParser(prog="scripts/make_example_evals.py", description=__doc__.split("\n\n")[0]).parse_args()
    rng = random.Random(1234)
    write_jsonl(ROOT / "search" / "data.jsonl", search_rows(rng))
    write_jsonl(ROOT / "billing" / "data.jsonl", billing_rows(rng))
    write_jsonl(ROOT / "support" / "data.jsonl", support_rows(rng))


if __name__ == "__main__":
    main()
