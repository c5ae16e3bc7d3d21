#!/usr/bin/env bash
# Engine matrix: runs `hxfer plan --verify --json` for every model preset, every pair
# of the 12 engine layouts (docs/layouts.md; vllm's shared tensors included), tp pairs 1->1 2->1 1->2 4->1 1->4 2->4 and pp pairs
# (1,1) (2,1) (1,2), and checks that every run moves and verifies every byte. Each side uses
# 32 tokens per block, or the vLLM block size its Mamba page needs; the request is 64 tokens
# (or that larger block size). A combination the model cannot shard (tp/pp divisibility) is
# counted as "not shardable", never as a pass; any other error or verified:false is a failure.
#
# Usage: scripts/engine-matrix.sh [--hxfer PATH] [--presets "a b"] [--quick] [--shared-only]
#                                 [--out FILE]
#   --hxfer PATH     binary to run (default: build/hxfer in the repository)
#   --presets "a b"  presets to run, in this order (default: every one `hxfer models` lists)
#   --quick          only tiny-hybrid and granite-4.0-h-tiny
#   --shared-only    only the pairs with a vllm shared-tensors side (44 of the 144)
#   --out FILE       also write one JSON line per case, per preset and the summary to FILE
# Exits 1 if any case failed.
set -euo pipefail

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
hxfer="$repo_root/build/hxfer"
presets_arg=""
quick=0
out=""

usage() { sed -n '9,16p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
shared_only=0

while [[ $# -gt 0 ]]; do
  case "$1" in
    --hxfer) hxfer=${2:?--hxfer needs a path}; shift 2 ;;
    --presets) presets_arg=${2?--presets needs a list}; shift 2 ;;
    --quick) quick=1; shift ;;
    --shared-only) shared_only=1; shift ;;
    --out) out=${2:?--out needs a file}; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "engine-matrix: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done

[[ -x "$hxfer" ]] || { echo "engine-matrix: no executable hxfer at '$hxfer'" >&2; exit 2; }

# Presets: the first column of `hxfer models` between the header and the first blank line.
all_presets=$("$hxfer" models | awk 'NR == 1 { next } /^[[:space:]]*$/ { exit } { print $1 }')
if [[ $quick == 1 ]]; then
  presets=(tiny-hybrid granite-4.0-h-tiny)
elif [[ -n "$presets_arg" ]]; then
  read -r -a presets <<<"$presets_arg"
else
  mapfile -t presets <<<"$all_presets"
fi
for p in "${presets[@]}"; do
  grep -qxF -- "$p" <<<"$all_presets" || { echo "engine-matrix: unknown preset '$p'" >&2; exit 2; }
done

# The 10 engine layouts of allEngineLayouts() and the 2 of sharedEngineLayouts(): engine kv
# conv state shared ("-" = option not given; an engine refuses an option it does not have).
layouts=(
  "hxfer - - paged -"
  "hxfer - - layer-major -"
  "trtllm-v1 - - - -"
  "trtllm-v2 hnd - - -"
  "trtllm-v2 nhd - - -"
  "vllm nhd sd - -"
  "vllm nhd ds - -"
  "vllm hnd sd - -"
  "vllm hnd ds - -"
  "sglang - - - -"
  "vllm nhd sd - on"
  "vllm hnd ds - on"
)
tp_pairs=("1 1" "2 1" "1 2" "4 1" "1 4" "2 4")
pp_pairs=("1 1" "2 1" "1 2")
base_tpb=32
base_tokens=64

# Top-level fields of the --json report (two-space indent: not a nested object's).
re_verified=$'\n  "verified": (true|false)'
re_total_ops=$'\n  "total_ops": ([0-9]+)'
re_total_pack_ops=$'\n  "total_pack_ops": ([0-9]+)'
re_total_bytes=$'\n  "total_bytes": ([0-9]+)'
re_bytes_checked=$'\n  "bytes_checked": ([0-9]+)'

# Refusals that mean "this model cannot be sharded this way" (src/model/model.cc).
not_shardable_re='(tp=[0-9]+ does not divide|does not divide tp=[0-9]+|pp=[0-9]+ does not divide)'

layout_name() {  # engine kv conv state shared -> the name EngineLayout::toString() prints
  local e=$1 kv=$2 conv=$3 st=$4 sh=$5
  case "$e" in
    hxfer) echo "hxfer($st)" ;;
    trtllm-v2) echo "trtllm-v2(kv=$kv)" ;;
    vllm) if [[ $sh == on ]]; then echo "vllm(kv=$kv,conv=$conv,shared)";
          else echo "vllm(kv=$kv,conv=$conv)"; fi ;;
    *) echo "$e" ;;
  esac
}

add_side_args() {  # side engine kv conv state shared: append the --SIDE-* options it takes
  local s=$1 e=$2 kv=$3 conv=$4 st=$5 sh=$6
  args+=("--$s-engine" "$e")
  [[ $kv == - ]] || args+=("--$s-kv-layout" "$kv")
  [[ $conv == - ]] || args+=("--$s-conv-layout" "$conv")
  [[ $st == - ]] || args+=("--$s-layout" "$st")
  [[ $sh == - ]] || args+=("--$s-shared-tensors" "$sh")
}

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# The block size a vllm side needs: 0 when 32 is enough, else the N of "use at least N tokens
# per block" (probed with a plan that does not allocate; cached per model and side shape).
declare -A vllm_min_cache
vllm_min() {  # side model tp pp kv conv -> vllm_n (no subshell, so the cache persists)
  local s=$1 m=$2 tp=$3 pp=$4 kv=$5 conv=$6
  local key="$s|$m|$tp|$pp|$kv|$conv"
  if [[ -z "${vllm_min_cache[$key]+x}" ]]; then
    local msg n=0
    msg=$(nice -n 10 "$hxfer" plan --model "$m" --tokens "$base_tokens" \
          --tokens-per-block "$base_tpb" --"$s"-engine vllm --"$s"-kv-layout "$kv" \
          --"$s"-conv-layout "$conv" --"$s"-tp "$tp" --"$s"-pp "$pp" 2>&1 >/dev/null || true)
    if [[ $msg =~ use\ at\ least\ ([0-9]+)\ tokens\ per\ block ]]; then n=${BASH_REMATCH[1]}; fi
    vllm_min_cache[$key]=$n
  fi
  vllm_n=${vllm_min_cache[$key]}
}

json_line() {  # format args...: append one formatted line to --out
  [[ -n "$out" ]] || return 0
  local line
  printf -v line "$@"
  printf '%s\n' "$line" >>"$out"
}
[[ -z "$out" ]] || : >"$out"

declare -A p_cases p_ok p_fail p_ns p_ops p_pack p_bytes p_checked p_secs p_done
cases=0 ok=0 failed=0 not_shardable=0 sum_ops=0 sum_pack=0 sum_bytes=0 sum_checked=0
failures=()
stop=0
trap 'stop=1' INT TERM
start_all=$EPOCHREALTIME

secs_since() {  # EPOCHREALTIME at the start -> seconds since, one decimal (no subprocess)
  local a=${1/[.,]/} b=${EPOCHREALTIME/[.,]/} d
  d=$(( (b - a) / 100000 ))
  printf -v secs_out '%d.%d' $((d / 10)) $((d % 10))
}

for m in "${presets[@]}"; do
  [[ $stop == 0 ]] || break
  p_cases[$m]=0 p_ok[$m]=0 p_fail[$m]=0 p_ns[$m]=0 p_ops[$m]=0 p_pack[$m]=0
  p_bytes[$m]=0 p_checked[$m]=0 p_done[$m]=0
  start_preset=$EPOCHREALTIME
  echo "== $m"
  for cl in "${layouts[@]}"; do
    for gl in "${layouts[@]}"; do
      read -r ce ckv cconv cst csh <<<"$cl"
      read -r ge gkv gconv gst gsh <<<"$gl"
      [[ $shared_only == 0 || $csh == on || $gsh == on ]] || continue
      cname=$(layout_name $ce $ckv $cconv $cst $csh)
      gname=$(layout_name $ge $gkv $gconv $gst $gsh)
      for tpp in "${tp_pairs[@]}"; do
        for ppp in "${pp_pairs[@]}"; do
          [[ $stop == 0 ]] || break 4
          read -r ctp gtp <<<"$tpp"
          read -r cpp gpp <<<"$ppp"
          args=(plan --verify --json --model "$m" --tokens-per-block "$base_tpb"
                --ctx-tp "$ctp" --gen-tp "$gtp" --ctx-pp "$cpp" --gen-pp "$gpp")
          add_side_args ctx $ce $ckv $cconv $cst $csh
          add_side_args gen $ge $gkv $gconv $gst $gsh
          ctpb=$base_tpb gtpb=$base_tpb tokens=$base_tokens
          if [[ $ce == vllm ]]; then
            vllm_min ctx "$m" "$ctp" "$cpp" "$ckv" "$cconv"
            if [[ $vllm_n -gt 0 ]]; then ctpb=$vllm_n; args+=(--ctx-tokens-per-block "$vllm_n"); fi
          fi
          if [[ $ge == vllm ]]; then
            vllm_min gen "$m" "$gtp" "$gpp" "$gkv" "$gconv"
            if [[ $vllm_n -gt 0 ]]; then gtpb=$vllm_n; args+=(--gen-tokens-per-block "$vllm_n"); fi
          fi
          (( ctpb > tokens )) && tokens=$ctpb
          (( gtpb > tokens )) && tokens=$gtpb
          args+=(--tokens "$tokens")

          t0=$EPOCHREALTIME
          rc=0
          nice -n 10 "$hxfer" "${args[@]}" >"$tmp/stdout" 2>"$tmp/stderr" || rc=$?
          secs_since "$t0"; dt=$secs_out
          cases=$((cases + 1)); p_cases[$m]=$((p_cases[$m] + 1))

          # The report's top-level fields, read without a subprocess (jq costs more than a
          # small plan does).
          verified=false vops=0 vpack=0 vbytes=0 vchecked=0 report=""
          IFS= read -r -d '' report <"$tmp/stdout" || true
          [[ $report =~ $re_verified ]] && verified=${BASH_REMATCH[1]}
          [[ $report =~ $re_total_ops ]] && vops=${BASH_REMATCH[1]}
          [[ $report =~ $re_total_pack_ops ]] && vpack=${BASH_REMATCH[1]}
          [[ $report =~ $re_total_bytes ]] && vbytes=${BASH_REMATCH[1]}
          [[ $report =~ $re_bytes_checked ]] && vchecked=${BASH_REMATCH[1]}
          what="$m $cname tp$ctp pp$cpp -> $gname tp$gtp pp$gpp"
          if [[ $rc == 0 && $verified == true ]]; then
            status=verified
            ok=$((ok + 1)); p_ok[$m]=$((p_ok[$m] + 1))
            sum_ops=$((sum_ops + vops)); p_ops[$m]=$((p_ops[$m] + vops))
            sum_pack=$((sum_pack + vpack)); p_pack[$m]=$((p_pack[$m] + vpack))
            sum_bytes=$((sum_bytes + vbytes)); p_bytes[$m]=$((p_bytes[$m] + vbytes))
            sum_checked=$((sum_checked + vchecked)); p_checked[$m]=$((p_checked[$m] + vchecked))
            echo "ok   $what: ops=$vops pack_ops=$vpack bytes=$vbytes checked=$vchecked ${dt}s"
          elif [[ $rc != 0 && $verified != true ]] && grep -qE "$not_shardable_re" "$tmp/stderr"; then
            status=not_shardable
            not_shardable=$((not_shardable + 1)); p_ns[$m]=$((p_ns[$m] + 1))
            echo "skip $what: not shardable: $(grep -m1 -E "$not_shardable_re" "$tmp/stderr")"
          else
            status=failed
            failed=$((failed + 1)); p_fail[$m]=$((p_fail[$m] + 1))
            failures+=("$what")
            {
              echo "FAIL $what (exit $rc, verified=$verified)"
              echo "  command: nice -n 10 $hxfer ${args[*]}"
              echo "  --- stdout"; sed 's/^/  /' "$tmp/stdout"
              echo "  --- stderr"; sed 's/^/  /' "$tmp/stderr"
            }
          fi
          json_line '{"preset":"%s","ctx":"%s","gen":"%s","ctx_tp":%s,"gen_tp":%s,"ctx_pp":%s,"gen_pp":%s,"ctx_tokens_per_block":%s,"gen_tokens_per_block":%s,"tokens":%s,"status":"%s","exit":%s,"verified":%s,"total_ops":%s,"total_pack_ops":%s,"total_bytes":%s,"bytes_checked":%s,"seconds":%s}' \
            "$m" "$cname" "$gname" "$ctp" "$gtp" "$cpp" "$gpp" "$ctpb" "$gtpb" "$tokens" \
            "$status" "$rc" "$verified" "$vops" "$vpack" "$vbytes" "$vchecked" "$dt"
        done
      done
    done
  done
  secs_since "$start_preset"; p_secs[$m]=$secs_out
  pairs=$(( ${#layouts[@]} * ${#layouts[@]} ))
  [[ $shared_only == 0 ]] || pairs=44  # 2 shared x 12 + 10 x 2 shared
  expected=$(( pairs * ${#tp_pairs[@]} * ${#pp_pairs[@]} ))
  [[ ${p_cases[$m]} == "$expected" ]] && p_done[$m]=1
  echo "== $m: ${p_cases[$m]}/$expected cases, ${p_ok[$m]} verified, ${p_fail[$m]} failed," \
       "${p_ns[$m]} not shardable, ${p_secs[$m]}s"
done

secs_since "$start_all"; total_secs=$secs_out
echo
[[ $stop == 0 ]] || echo "engine-matrix: interrupted; the counts below are partial"
printf '%-20s %7s %8s %6s %9s %12s %14s %16s %8s %s\n' preset cases verified failed not-shard \
  ops pack_ops bytes_checked seconds complete
for m in "${presets[@]}"; do
  [[ -n "${p_cases[$m]+x}" ]] || continue
  complete=no; [[ ${p_done[$m]} == 1 ]] && complete=yes
  printf '%-20s %7s %8s %6s %9s %12s %14s %16s %8s %s\n' "$m" "${p_cases[$m]}" "${p_ok[$m]}" \
    "${p_fail[$m]}" "${p_ns[$m]}" "${p_ops[$m]}" "${p_pack[$m]}" "${p_checked[$m]}" \
    "${p_secs[$m]:-?}" "$complete"
  json_line '{"preset_summary":"%s","cases":%s,"verified":%s,"failed":%s,"not_shardable":%s,"total_ops":%s,"total_pack_ops":%s,"total_bytes":%s,"bytes_checked":%s,"seconds":%s,"complete":%s}' \
    "$m" "${p_cases[$m]}" "${p_ok[$m]}" "${p_fail[$m]}" "${p_ns[$m]}" "${p_ops[$m]}" \
    "${p_pack[$m]}" "${p_bytes[$m]}" "${p_checked[$m]}" "${p_secs[$m]:-null}" \
    "$([[ ${p_done[$m]} == 1 ]] && echo true || echo false)"
done
echo "total: $cases cases, $ok verified, $failed failed, $not_shardable not shardable," \
     "$sum_ops ops ($sum_pack pack ops), $sum_checked bytes checked, ${total_secs}s"
json_line '{"summary":true,"cases":%s,"verified":%s,"failed":%s,"not_shardable":%s,"total_ops":%s,"total_pack_ops":%s,"total_bytes":%s,"bytes_checked":%s,"seconds":%s,"interrupted":%s}' \
  "$cases" "$ok" "$failed" "$not_shardable" "$sum_ops" "$sum_pack" "$sum_bytes" "$sum_checked" \
  "$total_secs" "$([[ $stop == 1 ]] && echo true || echo false)"
if [[ $failed -gt 0 ]]; then
  echo "failed cases:"
  printf '  %s\n' "${failures[@]}"
  exit 1
fi
[[ $stop == 0 ]] || exit 130
