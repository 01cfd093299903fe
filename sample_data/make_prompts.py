"""Generate the reproducible sample prompt set used by the benchmarks.

Usage: python sample_data/make_prompts.py [--out sample_data/prompts.parquet] [--rows 240] [--seed 0]
Three prompt kinds, rows shuffled so lengths are mixed in file order:
  short  (~40%)  one-line questions from template x topic lists
  medium (~35%)  instructions (email / steps / comparison) with context, ~60-250 tokens
  long   (~25%)  "Summarize the following text:" + a ~300-1,500 token passage
max_tokens is drawn independently of the kind: ~1/2 in 16-64, ~1/4 in 65-128, ~1/4 in 129-256.
"""
import argparse
import random

import pyarrow as pa
import pyarrow.parquet as pq

SHORT_T = ["What is {x}?", "Explain {x} in one sentence.", "Why is {x} important?", "Give a one-line definition of {x}.",
           "Who first described {x}?", "Name three facts about {x}.", "How does {x} work, briefly?", "Is {x} still relevant today?"]
TOPICS = ["photosynthesis", "inflation", "the Roman Empire", "machine learning", "plate tectonics", "the French Revolution",
          "compound interest", "black holes", "supply chains", "the immune system", "climate change", "the printing press",
          "quantum entanglement", "public key cryptography", "the water cycle", "game theory", "the Silk Road",
          "natural selection", "a balance sheet", "the stock market", "vaccination", "the Industrial Revolution",
          "renewable energy", "the speed of light", "DNA replication", "opportunity cost", "the Great Wall of China"]
COUNTRIES = ["France", "Japan", "Brazil", "Canada", "Kenya", "Australia", "Norway", "Peru", "Vietnam", "Egypt", "Poland", "Chile"]

EMAIL_TO = ["my landlord", "a new client", "the hiring manager", "my team", "a supplier", "our project sponsor", "a professor"]
EMAIL_ABOUT = ["a delayed shipment", "rescheduling next week's meeting", "a billing error on the last invoice",
               "a request for two days of leave", "the results of the quarterly survey", "a broken heating system"]
STEPS = ["set up a home vegetable garden", "prepare for a job interview", "back up a laptop", "plan a week of healthy meals",
         "start a small online shop", "train for a first 10k run", "organise a community fundraiser", "learn a new language"]
PAIRS = [("trains", "planes"), ("renting", "buying a home"), ("Python", "JavaScript"), ("solar", "wind power"),
         ("e-books", "paper books"), ("remote work", "office work"), ("index funds", "individual stocks"), ("tea", "coffee")]
CONTEXT = ["The situation has been going on for about three weeks now.", "I would like the tone to be polite but firm.",
           "The audience has no technical background.", "Budget is limited, so cheap options are preferred.",
           "We already tried the obvious fix and it did not help.", "Please keep the answer practical rather than theoretical.",
           "There is a deadline at the end of the month.", "Several people on the team disagree about the best approach.",
           "Last year a similar attempt failed because nobody owned the follow-up.", "The reader will skim, so clarity matters.",
           "Assume the reader lives in a mid-sized European city.", "Mention any common mistakes people make.",
           "I have tried to explain this before and it did not land well.", "Include a short note on costs if relevant.",
           "A few people involved are new and may need extra context.", "Avoid jargon unless you explain it in the same sentence.",
           "The previous version of this was far too long and nobody read it.", "If there are legal or safety issues, flag them clearly."]
TAILS = ["Use at most five bullet points.", "Keep it under 150 words.", "End with a clear recommendation.",
         "Write it in a friendly tone.", "Number each step.", ""]

# Long passages: per-topic slot vocab + sentence templates, plus generic ones; {S} is the passage's fixed subject.
GENERIC = ["It is worth pausing on why this mattered so much for {S}.", "Not all observers agreed with this reading of events.",
           "Seen from a distance, the pattern looks clearer than it did at the time.", "This point is often overlooked in shorter accounts.",
           "The details, however, tell a more complicated story.", "Several factors combined to produce this outcome.",
           "For {S}, the consequences were felt for years afterwards.", "A closer look at the numbers supports this interpretation.",
           "Even so, some questions about {S} remain unanswered.", "These changes did not happen overnight."]
PASSAGE = {
    "history": dict(S=["the city of Aldmere", "the kingdom of Varros", "the port of Selenna", "the Corran dynasty"],
        a=["merchants", "farmers", "soldiers", "monks", "local nobles", "craftsmen"], c=["twelfth", "fourteenth", "sixteenth", "eighteenth"],
        e=["a long drought", "a civil war", "a border dispute", "a wave of plague", "a series of poor harvests"],
        t=["the river trade", "the new tax laws", "the cathedral", "the harbour walls", "the royal archive"],
        T=["In the {c} century, {S} was shaped largely by {e}.", "Contemporary accounts suggest that {a} in {S} resented {t}.",
           "Historians still debate how much {e} changed daily life for {a}.", "By the end of the {c} century, {t} had become a symbol of {S}.",
           "Records kept by {a} describe rising prices and frequent disputes over land.", "The rulers of {S} responded by investing heavily in {t}.",
           "Not everyone benefited; {a} often bore the cost of these decisions.", "Archaeological finds near {t} support this view.",
           "Later chroniclers, writing long after {e}, tended to exaggerate its effects.", "What is clear is that {S} never fully returned to its earlier prosperity."]),
    "science": dict(S=["the research team", "the laboratory", "the survey group", "the field station"],
        a=["soil bacteria", "coral reefs", "migratory birds", "river sediments", "alpine plants"], c=["three", "five", "eight", "twelve"],
        e=["rising temperatures", "changes in acidity", "seasonal flooding", "nitrogen runoff"], t=["sampling method", "control group", "data set", "model"],
        T=["Over {c} years, {S} measured how {a} responded to {e}.", "The initial hypothesis was that {e} would reduce the diversity of {a}.",
           "To test this, {S} designed a new {t} that could be repeated across sites.", "The results were more mixed than expected.",
           "In some plots, {a} recovered quickly once {e} eased.", "Critics argued that the {t} was too small to support strong conclusions.",
           "{S} acknowledged this limitation and expanded the {t} in later seasons.", "Independent groups have since reported similar patterns in {a}.",
           "The findings suggest that {e} interacts with local conditions in ways simple models miss.", "Further work will focus on long-term monitoring."]),
    "business": dict(S=["Northwind Logistics", "Brightline Foods", "Kestrel Software", "Harbor & Finch"],
        a=["customers", "suppliers", "regional managers", "shareholders", "new hires"], c=["second", "third", "fourth"],
        e=["higher fuel costs", "a weaker currency", "slower demand in Europe", "a product recall"], t=["gross margin", "operating costs", "revenue", "cash flow"],
        T=["In the {c} quarter, {S} reported that {t} grew faster than forecast.", "Management attributed part of the change to {e}.",
           "Feedback from {a} pointed to delivery times as the main concern.", "{S} plans to reduce {t} by consolidating two warehouses.",
           "Analysts noted that {e} is likely to weigh on results next year.", "The board approved a modest increase in the dividend.",
           "Meanwhile, {a} were offered a revised contract with clearer terms.", "The company expects {t} to stabilise by the {c} quarter.",
           "Risks include {e} and increased competition from smaller firms.", "Overall, {S} described the period as challenging but encouraging."]),
    "travel": dict(S=["the old town", "the coastal road", "the mountain village", "the island"],
        a=["hikers", "families", "backpackers", "photographers", "food lovers"], c=["early morning", "late afternoon", "the off season", "midsummer"],
        e=["narrow cobbled streets", "a busy fish market", "steep terraced vineyards", "a ruined fortress"], t=["ferry", "night bus", "regional train", "bike path"],
        T=["Most visitors reach {S} by the {t}, which is slow but scenic.", "{S} is best explored in {c}, when the crowds thin out.",
           "{a} tend to head straight for {e}.", "Accommodation ranges from simple guesthouses to a single upmarket hotel.",
           "Locals recommend trying the grilled fish and the sweet almond pastries.", "In {c} the light over {e} is especially striking.",
           "Prices rise sharply in August, so booking ahead is wise.", "A short walk from {S} leads to {e}, often overlooked by {a}.",
           "The {t} stops running early, which catches many visitors out.", "Despite its growing popularity, {S} has kept much of its character."]),
    "technology": dict(S=["the new storage system", "the mobile app", "the billing platform", "the search service"],
        a=["engineers", "product managers", "support staff", "early users"], c=["two", "four", "six", "nine"],
        e=["a memory leak", "slow database queries", "a misconfigured cache", "network timeouts"], t=["latency", "error rate", "test coverage", "deployment time"],
        T=["The team rebuilt {S} over {c} months to improve {t}.", "Early load tests revealed {e} under heavy traffic.",
           "{a} traced most incidents back to {e}.", "A staged rollout let {a} compare the old and new versions side by side.",
           "After the change, {t} dropped noticeably for most requests.", "Not every problem disappeared; {e} still appeared occasionally.",
           "The team added monitoring so that regressions in {t} are caught quickly.", "Documentation was rewritten so that {a} could onboard faster.",
           "In hindsight, the {c}-month timeline was optimistic.", "Future work includes simplifying {S} and retiring legacy code."]),
}


def fill(rng, tmpl, slots, subj):
    s = tmpl.format(S=subj, **{k: rng.choice(v) for k, v in slots.items() if k not in ("S", "T")})
    return s[0].upper() + s[1:]


def passage(rng, target_words):
    """Paragraphs of 4-7 sentences, stopping at the first sentence that reaches target_words."""
    topic = PASSAGE[rng.choice(sorted(PASSAGE))]
    subj, pool, paras, n = rng.choice(topic["S"]), topic["T"] + GENERIC, [], 0
    while n < target_words:
        para = []
        for t in rng.sample(pool, rng.randint(4, 7)):
            para.append(fill(rng, t, topic, subj))
            n += len(para[-1].split())
            if n >= target_words:
                break
        paras.append(" ".join(para))
    return "\n\n".join(paras)


def short(rng):
    if rng.random() < 0.15:
        return f"What is the capital of {rng.choice(COUNTRIES)}?"
    return rng.choice(SHORT_T).format(x=rng.choice(TOPICS))


def medium(rng):
    a, b = rng.choice(PAIRS)
    head = rng.choice([f"Write an email to {rng.choice(EMAIL_TO)} about {rng.choice(EMAIL_ABOUT)}.",
                       f"Give step-by-step instructions on how to {rng.choice(STEPS)}.",
                       f"Compare {a} and {b}, covering cost, convenience and long-term trade-offs."])
    return " ".join([head, *rng.sample(CONTEXT, rng.randint(4, 16)), rng.choice(TAILS)]).strip()


def long(rng):  # 250-1,200 words ~ 300-1,500 SmolLM2 tokens (~1.2 tokens/word for this prose)
    return "Summarize the following text:\n\n" + passage(rng, rng.randint(250, 1200))


def max_tokens(rng):
    r = rng.random()
    return rng.randint(16, 64) if r < 0.5 else rng.randint(65, 128) if r < 0.75 else rng.randint(129, 256)


def build(rows, seed):
    rng = random.Random(seed)
    n_short, n_med = round(rows * 0.40), round(rows * 0.35)
    kinds = ["short"] * n_short + ["medium"] * n_med + ["long"] * (rows - n_short - n_med)
    prompts = [{"short": short, "medium": medium, "long": long}[k](rng) for k in kinds]
    rng.shuffle(prompts)
    return {"id": [f"p{i:04d}" for i in range(rows)], "prompt": prompts, "max_tokens": [max_tokens(rng) for _ in range(rows)]}


def pct(xs, q):
    return sorted(xs)[min(len(xs) - 1, int(q / 100 * len(xs)))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="sample_data/prompts.parquet")
    ap.add_argument("--rows", type=int, default=240)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    cols = build(args.rows, args.seed)
    schema = pa.schema([("id", pa.string()), ("prompt", pa.string()), ("max_tokens", pa.int32())])
    pq.write_table(pa.table(cols, schema=schema), args.out)
    words = [len(p.split()) for p in cols["prompt"]]
    print(f"wrote {args.rows} rows to {args.out}")
    print("prompt words: " + "  ".join(f"p{q}={pct(words, q)}" for q in (10, 25, 50, 75, 90, 99)) + f"  max={max(words)}")
    print(f"max_tokens: sum={sum(cols['max_tokens'])}  p50={pct(cols['max_tokens'], 50)}  max={max(cols['max_tokens'])}")


if __name__ == "__main__":
    main()
