# step replays under each setting (as gpu_variants.sh), then the setting with the shortest whole speculative step
# (mean over its runs) written to /root/choice.env, which later gpu_bench.sh stages on the machine source; the
# empty setting (the defaults) is always among them.  usage: bash benchmarks/gpu_pick.sh "VAR=V ..." ...
bash benchmarks/gpu_variants.sh "" "$@" "" "$@" | tee ${OUT:-/tmp}/variants.txt
awk '/^--- /{s=substr($0,5)} /whole speculative step/{split($0,f,"|"); t[s]+=f[3]; n[s]++}
     END{best=""; for (s in t) if (!(best in t) || t[s]/n[s] < t[best]/n[best]) best=s
         for (s in t) printf "mean %.4f ms  %s\n", t[s]/n[s], (s == "" ? "(defaults)" : s)
         print "picked: " (best == "" ? "(defaults)" : best)
         printf "%s", (best == "" ? "" : "export " best "\n") > "/root/choice.env"}' ${OUT:-/tmp}/variants.txt
