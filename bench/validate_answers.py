"""Validate bench_grammar's constrained answers against its schema with the
reference JSON Schema validator (jsonschema, with the format checker), and
print one JSON line: how many answers, how many parse and validate, and the
first failures. Exits 1 when an answer that ended on its own (finish "eos")
does not validate.

Usage: validate_answers.py BENCH_JSON ANSWERS_JSONL
"""
import importlib.metadata
import json
import sys

import jsonschema


def main():
    bench = json.load(open(sys.argv[1]))
    schema = json.loads(bench["schema"])
    validator = jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    total = finished = valid = 0
    failures = []
    for line in open(sys.argv[2]):
        answer = json.loads(line)
        total += 1
        if answer["finish"] != "eos":
            failures.append({"seed": answer["seed"], "finish": answer["finish"]})
            continue
        finished += 1
        try:
            validator.validate(json.loads(answer["text"]))
            valid += 1
        except (ValueError, jsonschema.ValidationError) as e:
            failures.append({"seed": answer["seed"], "error": str(e)[:200], "text": answer["text"][:300]})
    print(json.dumps({"answers": total, "finished": finished, "valid": valid,
                      "validator": "jsonschema " + importlib.metadata.version("jsonschema"),
                      "failures": failures[:5]}))
    sys.exit(0 if valid == finished and total > 0 else 1)


main()
