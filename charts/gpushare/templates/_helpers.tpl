{{/* Chart name, overridable. */}}
{{- define "gpushare.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-scoped base name: the release name if it already contains the chart name. */}}
{{- define "gpushare.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "gpushare.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Names of the three components. */}}
{{- define "gpushare.extender.fullname" -}}
{{- printf "%s-extender" (include "gpushare.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- define "gpushare.scheduler.fullname" -}}
{{- printf "%s-scheduler" (include "gpushare.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- define "gpushare.devicePlugin.fullname" -}}
{{- printf "%s-device-plugin" (include "gpushare.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- define "gpushare.webhook.fullname" -}}
{{- printf "%s-webhook" (include "gpushare.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The Secret holding the allocation keyring: the chart's own, or allocationSigning.existingSecret. */}}
{{- define "gpushare.allocationKeys.secretName" -}}
{{- if .Values.allocationSigning.existingSecret }}
{{- .Values.allocationSigning.existingSecret }}
{{- else }}
{{- printf "%s-allocation-keys" (include "gpushare.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* The Secret with the extender's serving certificate (ca.crt, tls.crt, tls.key): the chart's own, or extender.tls.existingSecret. */}}
{{- define "gpushare.extenderTls.secretName" -}}
{{- if .Values.extender.tls.existingSecret }}
{{- .Values.extender.tls.existingSecret }}
{{- else }}
{{- printf "%s-extender-tls" (include "gpushare.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* Where the extender mounts its serving certificate. */}}
{{- define "gpushare.extenderTls.dir" -}}
/etc/gpushare/extender-tls
{{- end }}

{{/* Whether the scheduler port asks callers for a client certificate (extender mode, HTTPS). */}}
{{- define "gpushare.clientAuth" -}}
{{- if and (ne .Values.mode "dra") .Values.extender.tls.enabled .Values.extender.tls.clientAuth.enabled }}true{{ end }}
{{- end }}

{{/* The Secret with the client CA and the certificates of the scheduler and the replicas. */}}
{{- define "gpushare.clientTls.secretName" -}}
{{- if .Values.extender.tls.clientAuth.existingSecret }}
{{- .Values.extender.tls.clientAuth.existingSecret }}
{{- else }}
{{- printf "%s-extender-client-tls" (include "gpushare.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* Where the extender mounts the client CA and its own client certificate. */}}
{{- define "gpushare.clientTls.dir" -}}
/etc/gpushare/client-tls
{{- end }}

{{/* Where the scheduler mounts its client certificate. */}}
{{- define "gpushare.clientTls.schedulerDir" -}}
/etc/gpushare/scheduler-client
{{- end }}

{{/*
The end of the upgrade grace (RFC 3339), only on the `helm upgrade` that creates the client
Secret: the release existed without client certificates, so its scheduler has none yet.
Empty on install, on `helm template`, on every later upgrade, and with
extender.tls.clientAuth.existingSecret (the certificates exist before the upgrade, and a
render must not depend on the clock).
*/}}
{{- define "gpushare.clientAuth.graceUntil" -}}
{{- if and (include "gpushare.clientAuth" .) .Release.IsUpgrade (not .Values.extender.tls.clientAuth.existingSecret) }}
{{- if not (lookup "v1" "Secret" .Release.Namespace (include "gpushare.clientTls.secretName" .)) }}
{{- dateInZone "2006-01-02T15:04:05Z" (now | dateModify (printf "+%dm" (int .Values.extender.tls.clientAuth.upgradeGraceMinutes))) "UTC" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Where the scheduler mounts the extender's CA (ca.crt only). */}}
{{- define "gpushare.extenderTls.caDir" -}}
/etc/gpushare/extender-ca
{{- end }}

{{/* Where the extender and the device plugin mount that Secret (a directory: kubelet updates it in place). */}}
{{- define "gpushare.allocationKeys.dir" -}}
/etc/gpushare/allocation-keys
{{- end }}

{{/* Labels on every object. Call with (dict "ctx" $ "component" "extender"). */}}
{{- define "gpushare.labels" -}}
helm.sh/chart: {{ include "gpushare.chart" .ctx }}
{{ include "gpushare.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: gpushare
{{- end }}

{{/* Labels that select a component's pods; never change them between upgrades. */}}
{{- define "gpushare.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpushare.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* image reference; the tag defaults to the chart's appVersion. Call with (dict "image" .Values.x.image "ctx" $). */}}
{{- define "gpushare.image" -}}
{{- include "gpushare.registry" (dict "ref" (printf "%s:%s" .image.repository (default .ctx.Chart.AppVersion .image.tag)) "ctx" .ctx) }}
{{- end }}

{{/*
An image reference (`ref`) moved to global.imageRegistry when that is set: the registry host
of `ref` (its first path part when that has a `.` or `:`, or is `localhost`) is replaced, or
the registry is put in front when `ref` names none (`ghcr.io/example/gpushare-extender:0.1.0`
→ `mirror.corp:5000/example/gpushare-extender:0.1.0`, `registry.k8s.io/pause:3.10` →
`mirror.corp:5000/pause:3.10`). Every image the chart names goes through here.
*/}}
{{- define "gpushare.registry" -}}
{{- $ref := .ref }}
{{- $registry := trimSuffix "/" ((.ctx.Values.global | default dict).imageRegistry | default "") }}
{{- if $registry }}
{{- $parts := splitList "/" $ref }}
{{- $host := first $parts }}
{{- if and (gt (len $parts) 1) (or (contains "." $host) (contains ":" $host) (eq $host "localhost")) }}
{{- $ref = join "/" (rest $parts) }}
{{- end }}
{{- printf "%s/%s" $registry $ref }}
{{- else }}
{{- $ref }}
{{- end }}
{{- end }}

{{/* kube-scheduler image tag: values, or the cluster's own vMAJOR.MINOR.0. */}}
{{- define "gpushare.scheduler.imageTag" -}}
{{- if .Values.scheduler.image.tag }}
{{- .Values.scheduler.image.tag }}
{{- else }}
{{- printf "v%s.%s.0" (regexReplaceAll "[^0-9]" .Capabilities.KubeVersion.Major "") (regexReplaceAll "[^0-9]" .Capabilities.KubeVersion.Minor "") }}
{{- end }}
{{- end }}

{{/* The participation label as key=value, for flags. */}}
{{- define "gpushare.nodeLabel" -}}
{{- printf "%s=%s" .Values.nodeLabel.key .Values.nodeLabel.value }}
{{- end }}

{{/* True when the chart runs its own scheduler (and the webhook routing pods to it). */}}
{{- define "gpushare.dedicated" -}}
{{- if eq .Values.scheduler.mode "dedicated" }}true{{ end }}
{{- end }}

{{/* GPU pods are routed to the dedicated scheduler at admission (webhook.enabled). */}}
{{- define "gpushare.routingEnabled" -}}
{{- if and (include "gpushare.dedicated" .) .Values.webhook.enabled }}true{{ end }}
{{- end }}

{{/* Routed by a MutatingAdmissionPolicy (the API server itself, no endpoint to be down):
forced by webhook.routeWith=admissionPolicy, or `auto` where the cluster serves it (1.36+). */}}
{{- define "gpushare.routingPolicy" -}}
{{- if include "gpushare.routingEnabled" . }}
{{- $with := .Values.webhook.routeWith | default "auto" }}
{{- if not (has $with (list "auto" "admissionPolicy" "webhook")) }}
{{- fail (printf "webhook.routeWith must be auto, admissionPolicy or webhook, not %q" $with) }}
{{- end }}
{{- if or (eq $with "admissionPolicy") (and (eq $with "auto") (.Capabilities.APIVersions.Has "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy")) }}true{{ end }}
{{- end }}
{{- end }}

{{/* Routed by the extender's webhook: older clusters, or webhook.routeWith=webhook (extender
mode only: in DRA mode the dra-gpu-mem policy routes). */}}
{{- define "gpushare.webhookEnabled" -}}
{{- if and (ne .Values.mode "dra") (include "gpushare.routingEnabled" .) (not (include "gpushare.routingPolicy" .)) }}true{{ end }}
{{- end }}

{{/* DRA mode ranks nodes through the extender (dra.scheduler.ranking, under the dedicated
scheduler): its filter keeps the best node, prioritize scores, kube-scheduler allocates and
binds. */}}
{{- define "gpushare.draRanking" -}}
{{- if and (eq .Values.mode "dra") (include "gpushare.dedicated" .) .Values.dra.scheduler.ranking }}true{{ end }}
{{- end }}

{{/* The extender runs: always in extender mode, in DRA mode for its ranking. */}}
{{- define "gpushare.extenderRuns" -}}
{{- if or (ne .Values.mode "dra") (include "gpushare.draRanking" .) }}true{{ end }}
{{- end }}

{{/* The extender keeps the idle-GPU taint (extender.idleGpuTaint): in extender mode, and in DRA mode with its ranking. */}}
{{- define "gpushare.idleGpuTaint" -}}
{{- if and (include "gpushare.extenderRuns" .) .Values.extender.idleGpuTaint }}true{{ end }}
{{- end }}

{{/*
The JSON patches (a CEL list expression) that give a GPU pod a toleration of the idle-GPU
taint, unless one of its tolerations already covers it: the taint is meant for pods that ask
for no GPU. Without it, the filter that keeps the best node steps aside for a GPU pod whenever
a candidate carries the taint, and kube-scheduler's TaintToleration score (weight 3) decides
instead of the extender's ranking.
*/}}
{{- define "gpushare.idleGpuTolerationPatches" -}}
{{- $key := printf "%s/idle-gpu" .Values.domain }}
{{- $toleration := printf "Object.spec.tolerations{key: '%s', operator: 'Exists', effect: 'PreferNoSchedule'}" $key -}}
(has(object.spec.tolerations) && object.spec.tolerations.exists(t,
(!has(t.effect) || t.effect == '' || t.effect == 'PreferNoSchedule') &&
((has(t.operator) && t.operator == 'Exists' && (!has(t.key) || t.key == '' || t.key == '{{ $key }}')) ||
(has(t.key) && t.key == '{{ $key }}' && (!has(t.value) || t.value == ''))))
? []
: has(object.spec.tolerations)
? [JSONPatch{op: 'add', path: '/spec/tolerations/-', value: {{ $toleration }}}]
: [JSONPatch{op: 'add', path: '/spec/tolerations', value: [{{ $toleration }}]}])
{{- end }}

{{/* The idle-GPU toleration ("gpushare.idleGpuTolerationPatches") as a mutation of its own (a
list item of a MutatingAdmissionPolicy's mutations). */}}
{{- define "gpushare.idleGpuTolerationMutation" -}}
- patchType: JSONPatch
  jsonPatch:
    expression: >-
      {{ include "gpushare.idleGpuTolerationPatches" . | nindent 6 | trim }}
{{- end }}

{{/* Allocations are signed: extender mode only (in DRA mode kube-scheduler writes them). */}}
{{- define "gpushare.signing" -}}
{{- if and (ne .Values.mode "dra") .Values.allocationSigning.enabled }}true{{ end }}
{{- end }}

{{/* The extender's URL as kube-scheduler calls it. */}}
{{- define "gpushare.extenderUrlPrefix" -}}
{{- printf "%s://%s.%s.svc:%v%s" (ternary "https" "http" .Values.extender.tls.enabled) (include "gpushare.extender.fullname" .) .Release.Namespace .Values.extender.port .Values.extender.prefix }}
{{- end }}

{{/* Fail early on values that cannot work. */}}
{{- define "gpushare.validate" -}}
{{- if not (has .Values.mode (list "extender" "dra")) }}
{{- fail (printf "mode must be \"extender\" or \"dra\", not %q" .Values.mode) }}
{{- end }}
{{- if not (has .Values.scheduler.mode (list "dedicated" "default-scheduler")) }}
{{- fail (printf "scheduler.mode must be \"dedicated\" or \"default-scheduler\", not %q" .Values.scheduler.mode) }}
{{- end }}
{{- if not (has .Values.policy (list "binpack" "spread" "fragmentation")) }}
{{- fail (printf "policy must be \"binpack\", \"spread\" or \"fragmentation\", not %q" .Values.policy) }}
{{- end }}
{{- if and .Values.scheduler.nativeGpuScoring (ne .Values.policy "binpack") }}
{{- fail (printf "scheduler.nativeGpuScoring ranks nodes as binpack does; policy %q needs the extender's prioritize: set policy=binpack or nativeGpuScoring=false" .Values.policy) }}
{{- end }}
{{- $percentage := .Values.scheduler.percentageOfNodesToScore }}
{{- $whole := kindIs "int64" $percentage }}
{{- if kindIs "float64" $percentage }}
{{- $whole = eq (float64 (int64 $percentage)) $percentage }}
{{- end }}
{{- if not $whole }}
{{- fail (printf "scheduler.percentageOfNodesToScore must be a whole number from 0 (kube-scheduler's adaptive default) to 100, not %v" $percentage) }}
{{- end }}
{{- if or (lt (int64 $percentage) 0) (gt (int64 $percentage) 100) }}
{{- fail (printf "scheduler.percentageOfNodesToScore must be a whole number from 0 (kube-scheduler's adaptive default) to 100, not %v" $percentage) }}
{{- end }}
{{- if lt (int64 .Values.extender.filterKeepBest) 0 }}
{{- fail (printf "extender.filterKeepBest must be 0 (every fitting node) or more, not %v" .Values.extender.filterKeepBest) }}
{{- end }}
{{- if and .Values.networkPolicy.enabled (not (include "gpushare.dedicated" .)) (not .Values.networkPolicy.schedulerPeers) }}
{{- fail "networkPolicy.enabled in default-scheduler mode needs networkPolicy.schedulerPeers: the peers (usually an ipBlock of the control-plane nodes) your kube-scheduler calls the extender from" }}
{{- end }}
{{- if not (has .Values.devicePlugin.enforcement.mode (list "" "preload" "none" "toolkit" "mps")) }}
{{- fail (printf "devicePlugin.enforcement.mode must be empty (it is deprecated: use isolation.mode), \"preload\", \"none\", \"toolkit\" or \"mps\", not %q" .Values.devicePlugin.enforcement.mode) }}
{{- end }}
{{- if not (has .Values.isolation.mode (list "preload" "none" "toolkit" "mps")) }}
{{- fail (printf "isolation.mode must be \"preload\", \"none\", \"toolkit\" or \"mps\", not %q" .Values.isolation.mode) }}
{{- end }}
{{- if not (has .Values.isolation.managedMemory (list "charge" "ignore")) }}
{{- fail (printf "isolation.managedMemory must be \"charge\" or \"ignore\", not %q" .Values.isolation.managedMemory) }}
{{- end }}
{{- if not (has .Values.isolation.compute (list "shared" "capped" "off")) }}
{{- fail (printf "isolation.compute must be \"shared\", \"capped\" or \"off\", not %q" .Values.isolation.compute) }}
{{- end }}
{{- $_ := include "gpushare.isolation.contextMiB" . }}
{{- if not (has .Values.devicePlugin.gpuBackend (list "nvml" "simulated")) }}
{{- fail (printf "devicePlugin.gpuBackend must be \"nvml\" or \"simulated\", not %q" .Values.devicePlugin.gpuBackend) }}
{{- end }}
{{- end }}

{{/* extender.filterKeepBest as the extender runs it: only under the dedicated scheduler,
     whose profile is the one the extender's ranking models (the default CPU and memory
     scores); 0 with scheduler.nativeGpuScoring (its profile scores GPU memory itself) and
     under a kube-scheduler the chart does not configure. */}}
{{- define "gpushare.filterKeepBest" -}}
{{- if and (include "gpushare.dedicated" .) (not .Values.scheduler.nativeGpuScoring) }}{{ int64 .Values.extender.filterKeepBest }}{{ else }}0{{ end }}
{{- end }}

{{/* The KubeSchedulerConfiguration of the dedicated scheduler. */}}
{{- define "gpushare.scheduler.config" -}}
apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
# scheduler.clientConnection and scheduler.parallelism.
{{- $client := .Values.scheduler.clientConnection }}
{{- if eq .Values.mode "dra" }}
{{- $client = .Values.dra.scheduler.clientConnection }}
{{- end }}
clientConnection:
  qps: {{ $client.qps }}
  burst: {{ int64 $client.burst }}
parallelism: {{ int64 .Values.scheduler.parallelism }}
leaderElection:
  leaderElect: true
  resourceLock: leases
  resourceName: {{ include "gpushare.scheduler.fullname" . }}
  resourceNamespace: {{ .Release.Namespace }}
profiles:
  - schedulerName: {{ .Values.scheduler.schedulerName }}
    {{- if eq .Values.mode "dra" }}
    # DRA mode: kube-scheduler allocates the claims itself (first fit over each node's
    # devices, in the order the DRA plugin publishes them) and scores nothing by what claims
    # leave free. With dra.scheduler.ranking the extender does: its filter keeps the node it
    # ranks best among those kube-scheduler found fit (extenders, below). Without it,
    # MostAllocated on CPU and memory sends each pod to the node whose CPU and memory are
    # most requested, so where GPU pods request CPU, nodes and their GPUs fill one after
    # another; scores are whole percents, so pods requesting almost no CPU tie on every node
    # and spread (docs/dra.md, "Packing"). dra.scheduler.percentageOfNodesToScore sets the
    # walk.
    percentageOfNodesToScore: {{ int64 .Values.dra.scheduler.percentageOfNodesToScore }}
    plugins:
      score:
        disabled:
          - name: NodeResourcesBalancedAllocation
          - name: ImageLocality
    pluginConfig:
      - name: NodeResourcesFit
        args:
          scoringStrategy:
            type: MostAllocated
            resources:
              - name: cpu
                weight: 1
              - name: memory
                weight: 1
      - name: PodTopologySpread
        args:
          defaultingType: List
    {{- else }}
    # scheduler.percentageOfNodesToScore (0: kube-scheduler's adaptive default).
    percentageOfNodesToScore: {{ int64 .Values.scheduler.percentageOfNodesToScore }}
    {{- if .Values.scheduler.nativeGpuScoring }}
    # scheduler.nativeGpuScoring: the scheduler itself prefers the node with the most GPU
    # memory requested (the extender's binpack prioritize ranks nodes the same way), so it
    # does not call prioritize; bind still picks the fullest GPU that fits on the node.
    pluginConfig:
      - name: NodeResourcesFit
        args:
          scoringStrategy:
            type: MostAllocated
            resources:
              - name: {{ .Values.resourceName }}
                weight: 1
    {{- else if include "gpushare.filterKeepBest" . | int }}
    # extender.filterKeepBest: the extender's filter passes the node this profile would score
    # best, ranked by its CPU and memory scores and ours. The two score plugins whose inputs
    # it does not read are off, so a pod that is scored (one with soft preferences of its
    # own) is ranked the same way: ImageLocality, and the topology spreading kube-scheduler
    # adds by default to pods of a Service or ReplicaSet (explicit constraints still apply).
    plugins:
      score:
        disabled:
          - name: ImageLocality
    pluginConfig:
      - name: PodTopologySpread
        args:
          defaultingType: List
    {{- end }}
    {{- end }}
{{- if include "gpushare.extenderRuns" . }}
extenders:
  - urlPrefix: {{ include "gpushare.extenderUrlPrefix" . }}
    filterVerb: filter
    {{- if not .Values.scheduler.nativeGpuScoring }}
    prioritizeVerb: prioritize
    weight: {{ .Values.scheduler.extender.weight }}
    {{- end }}
    {{- if eq .Values.mode "dra" }}
    # DRA mode: the extender only ranks; kube-scheduler allocates the claims and binds.
    {{- else }}
    bindVerb: bind
    {{- if .Values.scheduler.extender.preempt }}
    # Victims chosen per GPU: only pods whose going makes room on one GPU.
    preemptVerb: preempt
    {{- end }}
    {{- end }}
    {{- if .Values.extender.tls.enabled }}
    # Verified against the CA of the extender's certificate (the Secret's ca.crt, mounted).
    enableHTTPS: true
    tlsConfig:
      caFile: {{ include "gpushare.extenderTls.caDir" . }}/ca.crt
      {{- if include "gpushare.clientAuth" . }}
      # The client certificate the extender asks for (extender.tls.clientAuth).
      certFile: {{ include "gpushare.clientTls.schedulerDir" . }}/tls.crt
      keyFile: {{ include "gpushare.clientTls.schedulerDir" . }}/tls.key
      {{- end }}
    {{- else }}
    enableHTTPS: false
    {{- end }}
    nodeCacheCapable: true
    httpTimeout: {{ .Values.scheduler.extender.httpTimeout }}
    {{- if eq .Values.mode "dra" }}
    # Down or slow, the extender is skipped and DRA pods still schedule (first fit);
    # kube-scheduler's allocator decides what fits either way. Every pod of this profile is
    # a GPU pod (the dra-gpu-mem policy routes them), so no managedResources.
    ignorable: true
    {{- else }}
    ignorable: {{ .Values.scheduler.extender.ignorable }}
    managedResources:
      - name: {{ .Values.resourceName }}
        ignoredByScheduler: false
      # A pod asking for compute alone comes here too, to be refused with the reason.
      - name: {{ include "gpushare.computeResourceName" . }}
        ignoredByScheduler: false
    {{- end }}
{{- end }}
{{- end }}

{{/* The compute resource that goes with resourceName: its domain, named gpu-compute
     (gpushare_contract::request::compute_resource_of). */}}
{{- define "gpushare.computeResourceName" -}}
{{- $parts := splitList "/" .Values.resourceName -}}
{{- if gt (len $parts) 1 }}{{ index $parts 0 }}/gpu-compute{{ else }}gpu-compute{{ end -}}
{{- end }}

{{/* The isolation mode the plugins run with: devicePlugin.enforcement.mode (deprecated) when set, else isolation.mode. */}}
{{- define "gpushare.isolationMode" -}}
{{- .Values.devicePlugin.enforcement.mode | default .Values.isolation.mode -}}
{{- end }}

{{/* isolation.contextMiB as the plugins take it: empty when unset (null or ""), else the
     whole number of MiB (a values file gives it as a float, --set as an integer); fails on
     anything the interposer would refuse. */}}
{{- define "gpushare.isolation.contextMiB" -}}
{{- $mib := .Values.isolation.contextMiB }}
{{- if not (or (kindIs "invalid" $mib) (eq (toString $mib) "")) }}
{{- $whole := kindIs "int64" $mib }}
{{- if kindIs "float64" $mib }}
{{- $whole = eq (float64 (int64 $mib)) $mib }}
{{- end }}
{{- if or (not $whole) (lt (int64 $mib) 0) (gt (int64 $mib) 1048576) }}
{{- fail (printf "isolation.contextMiB must be empty (the interposer's default, 512 MiB) or a whole number of MiB from 0 to 1048576, not %v" $mib) }}
{{- end }}
{{- int64 $mib }}
{{- end }}
{{- end }}

{{/* The plugins' flags for isolation.mode preload (both modes): where the interposer comes
     from and goes, who is exempt, and its settings, each of these passed only when set away
     from the interposer's default (a plugin not asked hands containers the environment it
     always did). */}}
{{- define "gpushare.isolation.args" -}}
- --isolation-library={{ .Values.isolation.libraryPath }}
- --isolation-host-dir={{ .Values.isolation.hostDir }}
{{- with .Values.isolation.exemptNamespaces }}
- --isolation-exempt-namespaces={{ join "," . }}
{{- end }}
{{- with include "gpushare.isolation.contextMiB" . }}
- --isolation-context-mib={{ . }}
{{- end }}
{{- if ne .Values.isolation.managedMemory "charge" }}
- --isolation-managed-memory={{ .Values.isolation.managedMemory }}
{{- end }}
{{- if ne .Values.isolation.compute "shared" }}
- --isolation-compute={{ .Values.isolation.compute }}
{{- end }}
{{- end }}

{{/*
The node plugins (device plugin, DRA plugin) run as root with hostPath volumes: Pod Security
admits them only at `privileged`. A release namespace that enforces `baseline` or `restricted`
would let helm install everything and then refuse the DaemonSet's pods, so installing fails
here with what to do. Only where helm can read the Namespace (install/upgrade; `helm template`
has no cluster and skips it).
*/}}
{{- define "gpushare.podSecurityCheck" -}}
{{- $ns := lookup "v1" "Namespace" "" .Release.Namespace }}
{{- if $ns }}
{{- $level := index ($ns.metadata.labels | default dict) "pod-security.kubernetes.io/enforce" | default "privileged" }}
{{- if ne $level "privileged" }}
{{- fail (printf "namespace %s enforces Pod Security %q, but the gpushare node plugin runs as root with hostPath volumes (kubelet's plugin sockets) and is admitted only at \"privileged\": label it pod-security.kubernetes.io/enforce=privileged, or install into a namespace that is (kube-system is, unless relabelled)" .Release.Namespace $level) }}
{{- end }}
{{- end }}
{{- end }}

{{/* The `helm test` pod (and its ServiceAccount and grants): templates/tests/check-install.yaml. */}}
{{- define "gpushare.checkInstall.name" -}}
{{- printf "%s-check-install" (include "gpushare.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
