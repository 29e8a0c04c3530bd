#!/bin/sh
# Flags the API would refuse are usage errors (exit 2) naming the flag, before
# any work: a bias on a token past the vocabulary, a schema keyword the grammar
# would not enforce, an output file that cannot be written, a negative count, a
# directory given for an input file.
#   flag_refusals_test.sh PD_MAKE_MODEL PD_GENERATE PD_PERPLEXITY
set -e
make_model=$1 generate=$2 perplexity=$3
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
"$make_model" --shape tiny --type q4_0 --embed-type q8_0 --seed 3 --out "$d/a.gguf"

# refused FLAG COMMAND...: COMMAND exits 2 and its message names FLAG.
refused() {
  flag=$1
  shift
  if "$@" > /dev/null 2> "$d/err.txt"; then
    echo "accepted: $*"
    exit 1
  else
    rc=$?
  fi
  [ "$rc" -eq 2 ] || { echo "exit $rc (want 2): $*"; cat "$d/err.txt"; exit 1; }
  grep -q -- "$flag" "$d/err.txt" || { echo "no '$flag' in the message of: $*"; cat "$d/err.txt"; exit 1; }
}

refused --logit-bias "$generate" -m "$d/a.gguf" -p hi -n 2 -t 1 --logit-bias 99999999=5
refused --json-schema.properties.a.not "$generate" -m "$d/a.gguf" -p hi -n 2 -t 1 \
  --json-schema '{"type":"object","properties":{"a":{"not":{}}},"required":["a"]}'
refused --json "$perplexity" -m "$d/a.gguf" -f "$d/a.gguf" --json "$d/no/such/dir/out.json"
refused --chunks "$perplexity" -m "$d/a.gguf" -f "$d/a.gguf" --chunks -5
# Thread counts past any machine; a directory where a file is read; n-grams out of order.
refused --threads "$generate" -m "$d/a.gguf" -p hi -n 2 -t 100000
refused --threads "$perplexity" -m "$d/a.gguf" -f "$d/a.gguf" -t 100000
refused "$d" "$perplexity" -m "$d/a.gguf" -f "$d"
refused --regex "$generate" -m "$d/a.gguf" -p hi -n 2 -t 1 --regex "@$d"
refused "--batch file" "$generate" -m "$d/a.gguf" -n 2 -t 1 --batch "$d"
refused --chat-template "$generate" -m "$d/a.gguf" -p hi -n 2 -t 1 --chat --chat-template foo
printf '{"prompt": "hi", "top_p": 0.5}\n' > "$d/unknown.jsonl"
refused 'unknown field "top_p"' "$generate" -m "$d/a.gguf" -t 1 --batch "$d/unknown.jsonl"
printf '{"prompt": "hi", "max_tokens": "x"}\n' > "$d/type.jsonl"
refused "type.jsonl:1" "$generate" -m "$d/a.gguf" -t 1 --batch "$d/type.jsonl"
refused --ngram-min "$generate" -m "$d/a.gguf" -p hi -n 2 -t 1 --ngram-min 5 --ngram-max 2
echo "every flag refused, naming itself"
