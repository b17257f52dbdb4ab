package kubeharness

import (
	"os"
	"path/filepath"
	"testing"
)

// breakers are deliberately broken drivers: the installed flexhub executable is moved to a
// dot-name (the prober ignores dot-names) and replaced by a small sh wrapper that breaks one
// rule and passes everything else through. tests/test_kubeharness.py runs the harness with
// each one and requires the named check to fail: that is how every check was seen to fail
// before it was trusted.
var breakers = map[string]string{
	// Prints a warning on stderr: kubelet merges stderr into the reply.
	"stderr": `echo "flexhub: warning: something" >&2; exec "$real" "$@"`,
	// A second JSON value after the reply.
	"twojson": `"$real" "$@"; rc=$?; echo '{"status":"Success"}'; exit $rc`,
	// Answers Success to mount without mounting anything.
	"nomount": `if [ "$1" = mount ]; then echo '{"status":"Success"}'; exit 0; fi; exec "$real" "$@"`,
	// Ignores a read-only claim: mounts read-write.
	"noro": `if [ "$1" = mount ]; then j=$(printf '%s' "$3" | sed 's|"kubernetes.io/readwrite":"ro"|"kubernetes.io/readwrite":"rw"|'); exec "$real" mount "$2" "$j"; fi; exec "$real" "$@"`,
	// An init without supportsMetrics (kubelet then has no metrics for the volume).
	"nometrics": `if [ "$1" = init ]; then echo '{"status":"Success","capabilities":{"attach":false,"fsGroup":false}}'; exit 0; fi; exec "$real" "$@"`,
	// Answers Success to expandfs without growing.
	"noexpand": `if [ "$1" = expandfs ]; then echo '{"status":"Success"}'; exit 0; fi; exec "$real" "$@"`,
	// Answers Success to unmount without unmounting.
	"nounmount": `if [ "$1" = unmount ]; then echo '{"status":"Success"}'; exit 0; fi; exec "$real" "$@"`,
	// Answers "Not supported" to unmount (kubelet caches it and unmounts by itself).
	"notsupported": `if [ "$1" = unmount ]; then echo '{"status":"Not supported"}'; exit 1; fi; exec "$real" "$@"`,
	// Fails the unmount of a directory that is not a mount point.
	"unmountstrict": `if [ "$1" = unmount ] && ! mountpoint -q "$2"; then echo '{"status":"Failure","message":"not mounted"}'; exit 1; fi; exec "$real" "$@"`,
	// Needs the options on unmount (kubelet sends none; after a restart it knows nothing).
	"needsoptions": `if [ "$1" = unmount ] && [ $# -lt 3 ]; then echo '{"status":"Failure","message":"unmount needs options"}'; exit 1; fi; exec "$real" "$@"`,
	// Ignores the pod's fsGroup.
	"nofsgroup": `if [ "$1" = mount ]; then j=$(printf '%s' "$3" | sed 's|"kubernetes.io/mounterArgs.FsGroup":"[0-9]*",||'); exec "$real" mount "$2" "$j"; fi; exec "$real" "$@"`,
	// Reports a failed mount as plain text instead of a JSON Failure.
	"plainfail": `if [ "$1" = mount ]; then "$real" "$@" >/dev/null; rc=$?; [ $rc = 0 ] || echo "mount failed"; exit $rc; fi; exec "$real" "$@"`,
	// Installed under a directory name kubelet rejects (uppercase vendor).
	"badname": ``,
}

func applyBreak(t *testing.T, mode, exe string) {
	t.Helper()
	body, ok := breakers[mode]
	if !ok {
		t.Fatalf("unknown FLEXHUB_KH_BREAK %q", mode)
	}
	dir := filepath.Dir(exe)
	if mode == "badname" {
		bad := filepath.Join(filepath.Dir(dir), "K8s~flexhub")
		if err := os.Rename(dir, bad); err != nil {
			t.Fatal(err)
		}
		return
	}
	real := filepath.Join(dir, ".flexhub-real")
	if err := os.Rename(exe, real); err != nil {
		t.Fatal(err)
	}
	script := "#!/bin/sh\n# deliberately broken driver for the harness (" + mode + ")\nreal='" + real + "'\n" + body + "\n"
	tmp := filepath.Join(dir, ".flexhub-broken")
	if err := os.WriteFile(tmp, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, exe); err != nil {
		t.Fatal(err)
	}
	t.Logf("driver deliberately broken: %s", mode)
}
