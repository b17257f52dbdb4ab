package kubeharness

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	"k8s.io/client-go/tools/record"
	"k8s.io/kubernetes/pkg/volume"
)

// The ways drivers commonly break the real code. Every reply of every test is also judged
// by the recorder (one JSON object, nothing on stderr, never "Not supported", exit code
// matching the status).

// TestFailureReply: a mount flexhub must refuse reaches kubelet as a parsed Failure (not a
// JSON error), and kubelet removes the pod directory.
func TestFailureReply(t *testing.T) {
	cfg := loadConfig(t)
	cfg.options["no-such-option"] = "x"
	e := newEnv(t, cfg, v1.SecretType(driverName))
	k := e.start(t)
	m, err := k.plugin.NewMounter(volume.NewSpecFromPersistentVolume(e.pv("pv-bad", cfg.capacity), false), newPod("bad"))
	if err != nil {
		t.Fatal(err)
	}
	mark := k.rec.mark()
	err = m.SetUp(volume.MounterArgs{Recorder: record.NewFakeRecorder(16)})
	if err == nil || !strings.Contains(err.Error(), "mount command failed, status: Failure, reason: ") {
		t.Fatalf("SetUp with a bad option: %v; want the real code's parsed Failure", err)
	}
	k.oneCall(mark, "mount")
	if exists(m.GetPath()) {
		t.Errorf("kubelet could not remove %s after the failed mount", m.GetPath())
	}
	t.Logf("kubelet's error: %v", err)
}

// TestSecretType: kubelet hands a Secret to the driver only when its type is the driver
// name; any other type fails the mount before the driver runs.
func TestSecretType(t *testing.T) {
	cfg := loadConfig(t)
	if cfg.secret == nil {
		cfg.secret = map[string]string{"token": "kh-not-used"}
	}
	e := newEnv(t, cfg, v1.SecretTypeOpaque)
	k := e.start(t)
	m, err := k.plugin.NewMounter(volume.NewSpecFromPersistentVolume(e.pv("pv-secret", cfg.capacity), false), newPod("secret"))
	if err != nil {
		t.Fatal(err)
	}
	mark := k.rec.mark()
	err = m.SetUp(volume.MounterArgs{Recorder: record.NewFakeRecorder(16)})
	if err == nil || !strings.Contains(err.Error(), "cannot get secret of type "+driverName) {
		t.Fatalf("SetUp with an Opaque Secret: %v", err)
	}
	k.noCalls(mark, "mount with a Secret of the wrong type")
	if exists(m.GetPath()) {
		t.Errorf("%s left behind", m.GetPath())
	}
}

// TestDriverDirectory: the directory `flexhub install` writes is one the prober accepts,
// for the default and for a custom driver name; a name kubelet rejects is refused by the
// installer (kubelet would run its init and then drop it silently).
func TestDriverDirectory(t *testing.T) {
	cfg := loadConfig(t)
	e := newEnv(t, cfg, v1.SecretType(driverName))
	k := e.start(t)
	entries, err := os.ReadDir(e.pluginDir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, entry := range entries {
		names = append(names, entry.Name())
	}
	if strings.Join(names, ",") != "k8s~flexhub" {
		t.Errorf("plugin dir holds %v, want only k8s~flexhub", names)
	}
	if k.plugin.GetPluginName() != driverName {
		t.Errorf("plugin name %q", k.plugin.GetPluginName())
	}

	// A custom name (--driver acme/fs) is found under that name.
	other := filepath.Join(cfg.workdir, "exec-acme")
	installDriver(t, config{python: cfg.python, nodeConfig: cfg.nodeConfig}, other, "acme.example/fs")
	k2 := (&env{cfg: cfg, root: e.root, pluginDir: other, client: e.client}).startNamed(t, "acme.example/fs")
	if k2.plugin.GetPluginName() != "acme.example/fs" {
		t.Errorf("custom driver: plugin name %q", k2.plugin.GetPluginName())
	}

	// A name the prober rejects: the installer refuses it, and the real code does drop it.
	argv := []string{"-m", "flexhub", "install", "--plugin-dir", filepath.Join(cfg.workdir, "exec-bad"), "--driver", "Acme/fs"}
	if out, err := exec.Command(cfg.python, argv...).CombinedOutput(); err == nil {
		t.Errorf("flexhub install --driver Acme/fs succeeded (kubelet drops that name): %s", out)
	}
	bad := filepath.Join(cfg.workdir, "exec-upper")
	if err := os.MkdirAll(filepath.Join(bad, "Acme~fs"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Link(e.driverExe, filepath.Join(bad, "Acme~fs", "fs")); err != nil {
		t.Fatal(err)
	}
	probe := &env{cfg: cfg, root: e.root, pluginDir: bad, client: e.client}
	if _, err := probe.tryStart(t, "Acme/fs"); err == nil {
		t.Error("the real prober accepted the driver name Acme/fs")
	}
}

// TestUnmountNotMounted: kubelet retries unmount after a crash or a half-done TearDown;
// the driver must answer Success for a directory that is not (or no longer) mounted, and
// kubelet skips a directory that is gone without calling the driver.
func TestUnmountNotMounted(t *testing.T) {
	cfg := loadConfig(t)
	e := newEnv(t, cfg, v1.SecretType(driverName))
	k := e.start(t)
	pod := newPod("gone")
	dir := k.host.GetPodVolumeDir(pod.UID, "k8s~flexhub", "pv-never")
	if err := os.MkdirAll(dir, 0o750); err != nil {
		t.Fatal(err)
	}
	k.tearDown("pv-never", pod, dir)

	u, err := k.plugin.NewUnmounter("pv-never", pod.UID)
	if err != nil {
		t.Fatal(err)
	}
	mark := k.rec.mark()
	if err := u.TearDown(); err != nil {
		t.Fatalf("TearDown of a directory that no longer exists: %v", err)
	}
	k.noCalls(mark, "TearDown of a missing directory")
}
