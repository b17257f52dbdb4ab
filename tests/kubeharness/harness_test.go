// Package kubeharness drives flexhub with Kubernetes' own FlexVolume plugin code
// (k8s.io/kubernetes/pkg/volume/flexvolume at the release pinned in go.mod), a real exec
// and a real mounter, as kubelet does. See README.md in this directory.
//
// The test binary is configured by the environment (tests/test_kubeharness.py sets it):
//
//	FLEXHUB_KH_PYTHON          python that has flexhub installed (runs `-m flexhub install`)
//	FLEXHUB_KH_CONFIG          node config baked into the driver (`install --config`), optional
//	FLEXHUB_KH_WORKDIR         directory for the kubelet root and plugin dir (default: a temp dir)
//	FLEXHUB_KH_OPTIONS         JSON: the PV's flexVolume.options (with "backend")
//	FLEXHUB_KH_INLINE_OPTIONS  JSON: options of an inline volume (another volume), optional
//	FLEXHUB_KH_FSTYPE          flexVolume.fsType
//	FLEXHUB_KH_SECRET          JSON: data of the Secret the PV's secretRef names, optional
//	FLEXHUB_KH_CAPACITY        bytes: the filesystem size the pods should see (statfs)
//	FLEXHUB_KH_NEW_SIZE        bytes: the size NodeExpand asks for; 0 = the backend cannot grow
//	FLEXHUB_KH_GROW            JSON list of argv run before NodeExpand ("{size}" = new bytes)
//	FLEXHUB_KH_FSGROUP_ROOT    "1": flexhub gives the volume root the pod's fsGroup
//	FLEXHUB_KH_BREAK           a deliberately broken driver (see breakers below), for the
//	                           tests that show each check fails against one
package kubeharness

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/pkg/volume"
	"k8s.io/kubernetes/pkg/volume/flexvolume"
	volumetest "k8s.io/kubernetes/pkg/volume/testing"
	"k8s.io/mount-utils"
	utilexec "k8s.io/utils/exec"
)

const (
	driverName = "k8s/flexhub"
	namespace  = "default"
	secretName = "flexhub-chap"
)

func TestMain(m *testing.M) {
	klog.InitFlags(nil)
	_ = flag.Set("v", "4")
	flag.Parse()
	os.Exit(m.Run())
}

// ---- configuration from the environment -------------------------------------------------

type config struct {
	python, nodeConfig, workdir, fsType, breakMode string
	options, inlineOptions, secret                 map[string]string
	capacity, newSize                              int64
	grow                                           [][]string
	fsGroupRoot                                    bool
}

func loadConfig(t *testing.T) config {
	t.Helper()
	c := config{
		python:      os.Getenv("FLEXHUB_KH_PYTHON"),
		nodeConfig:  os.Getenv("FLEXHUB_KH_CONFIG"),
		workdir:     os.Getenv("FLEXHUB_KH_WORKDIR"),
		fsType:      os.Getenv("FLEXHUB_KH_FSTYPE"),
		breakMode:   os.Getenv("FLEXHUB_KH_BREAK"),
		fsGroupRoot: os.Getenv("FLEXHUB_KH_FSGROUP_ROOT") == "1",
	}
	if c.python == "" || os.Getenv("FLEXHUB_KH_OPTIONS") == "" {
		t.Fatal("FLEXHUB_KH_PYTHON and FLEXHUB_KH_OPTIONS must be set (run through tests/test_kubeharness.py)")
	}
	for name, dst := range map[string]*map[string]string{
		"FLEXHUB_KH_OPTIONS": &c.options, "FLEXHUB_KH_INLINE_OPTIONS": &c.inlineOptions, "FLEXHUB_KH_SECRET": &c.secret,
	} {
		if raw := os.Getenv(name); raw != "" {
			if err := json.Unmarshal([]byte(raw), dst); err != nil {
				t.Fatalf("%s: %v", name, err)
			}
		}
	}
	for name, dst := range map[string]*int64{"FLEXHUB_KH_CAPACITY": &c.capacity, "FLEXHUB_KH_NEW_SIZE": &c.newSize} {
		if raw := os.Getenv(name); raw != "" {
			v, err := strconv.ParseInt(raw, 10, 64)
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			*dst = v
		}
	}
	if raw := os.Getenv("FLEXHUB_KH_GROW"); raw != "" {
		if err := json.Unmarshal([]byte(raw), &c.grow); err != nil {
			t.Fatalf("FLEXHUB_KH_GROW: %v", err)
		}
	}
	if c.capacity == 0 {
		t.Fatal("FLEXHUB_KH_CAPACITY must be set")
	}
	if c.workdir == "" {
		c.workdir = t.TempDir()
	} else {
		dir, err := os.MkdirTemp(c.workdir, "kh-")
		if err != nil {
			t.Fatal(err)
		}
		c.workdir = dir
		t.Cleanup(func() { _ = os.RemoveAll(dir) })
	}
	return c
}

// ---- the recording runner given to the prober ---------------------------------------------

// call is one driver execution as the real code ran it.
type call struct {
	Argv   []string
	Output string
	Err    error
}

// op is the driver operation (argv[1]).
func (c call) op() string {
	if len(c.Argv) < 2 {
		return ""
	}
	return c.Argv[1]
}

// recorder wraps exec.New(): every driver run is recorded, and its merged reply checked
// against what kubelet needs: exactly one JSON object, status Success or Failure (never
// "Not supported", which kubelet caches and then replaces by its own defaults), exit 0
// exactly on Success.
type recorder struct {
	utilexec.Interface
	t          *testing.T
	mu         sync.Mutex
	calls      []call
	violations []string
}

func newRecorder(t *testing.T) *recorder {
	r := &recorder{Interface: utilexec.New(), t: t}
	t.Cleanup(func() {
		r.mu.Lock()
		defer r.mu.Unlock()
		for _, v := range r.violations {
			t.Errorf("driver reply breaks kubelet's rules: %s", v)
		}
	})
	return r
}

func (r *recorder) Command(cmd string, args ...string) utilexec.Cmd {
	return &recordedCmd{Cmd: r.Interface.Command(cmd, args...), r: r, argv: append([]string{cmd}, args...)}
}

func (r *recorder) ops() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]string, len(r.calls))
	for i, c := range r.calls {
		out[i] = c.op()
	}
	return out
}

func (r *recorder) mark() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.calls)
}

// since returns the calls made after mark().
func (r *recorder) since(mark int) []call {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]call(nil), r.calls[mark:]...)
}

type recordedCmd struct {
	utilexec.Cmd
	r    *recorder
	argv []string
}

func (c *recordedCmd) CombinedOutput() ([]byte, error) {
	started := time.Now()
	out, err := c.Cmd.CombinedOutput()
	rec := call{Argv: c.argv, Output: string(out), Err: err}
	c.r.mu.Lock()
	c.r.calls = append(c.r.calls, rec)
	if v := judgeReply(out, err); v != "" {
		c.r.violations = append(c.r.violations, fmt.Sprintf("%s: %s (output %q)", rec.op(), v, masked(string(out))))
	}
	c.r.mu.Unlock()
	c.r.t.Logf("driver %s -> %s (err %v, %s)", strings.Join(maskArgv(c.argv[1:]), " "), strings.TrimSpace(string(out)), err, time.Since(started).Round(time.Millisecond))
	return out, err
}

// judgeReply says what is wrong with one merged reply, or "".
func judgeReply(out []byte, err error) string {
	dec := json.NewDecoder(bytes.NewReader(out))
	var reply map[string]any
	if derr := dec.Decode(&reply); derr != nil {
		return "not a JSON object: " + derr.Error()
	}
	if rest := bytes.TrimSpace(out[dec.InputOffset():]); len(rest) > 0 {
		return "more than one JSON object"
	}
	if start := bytes.TrimSpace(out); len(start) == 0 || start[0] != '{' {
		return "output does not start with the JSON object"
	}
	status, _ := reply["status"].(string)
	switch status {
	case "Success":
		if err != nil {
			return "Success with exit error " + err.Error()
		}
	case "Failure":
		if err == nil {
			return "Failure with exit 0"
		}
		if msg, _ := reply["message"].(string); msg == "" || strings.Contains(msg, "\n") {
			return "Failure without a one-line message"
		}
	case "Not supported":
		return "Not supported (kubelet caches it and runs its own default instead)"
	default:
		return fmt.Sprintf("unknown status %q", status)
	}
	return ""
}

// masked hides secret option values in a JSON options string.
func masked(s string) string {
	var m map[string]string
	if json.Unmarshal([]byte(s), &m) != nil {
		return s
	}
	for k := range m {
		if strings.HasPrefix(k, "kubernetes.io/secret/") {
			m[k] = "***"
		}
	}
	b, _ := json.Marshal(m)
	return string(b)
}

func maskArgv(argv []string) []string {
	out := make([]string, len(argv))
	for i, a := range argv {
		out[i] = masked(a)
	}
	return out
}

// ---- the volume host: the fake kubelet host with the real mounter --------------------------

// realHost is pkg/volume/testing's fake kubelet volume host, except that GetMounter is the
// real mount.New(""): prepareForMount's "already mounted?" check, the metrics and the
// unmount defaults then look at the real mount table. (The VolumeHost has no GetExec;
// flexvolume's own defaults call exec.New() themselves, and the driver runs through the
// recorder given to the prober.)
type realHost struct {
	volume.VolumeHost
}

func (h *realHost) GetMounter() mount.Interface { return mount.New("") }

// kubelet is one "kubelet process": a prober, a plugin manager and the flexhub plugin.
type kubelet struct {
	t      *testing.T
	rec    *recorder
	host   volume.VolumeHost
	mgr    *volume.VolumePluginMgr
	plugin volume.VolumePlugin
	root   string
}

// env is the node shared by every kubelet of one test: the kubelet root, the plugin dir
// holding the installed driver, the API objects.
type env struct {
	cfg       config
	root      string
	pluginDir string
	driverExe string
	client    *fake.Clientset
}

func newEnv(t *testing.T, cfg config, secretType v1.SecretType) *env {
	t.Helper()
	e := &env{cfg: cfg, root: filepath.Join(cfg.workdir, "kubelet"), pluginDir: filepath.Join(cfg.workdir, "exec")}
	e.driverExe = installDriver(t, cfg, e.pluginDir, driverName)
	var objs []runtime.Object
	if cfg.secret != nil {
		data := map[string][]byte{}
		for k, v := range cfg.secret {
			data[k] = []byte(v)
		}
		objs = append(objs, &v1.Secret{
			ObjectMeta: metav1.ObjectMeta{Name: secretName, Namespace: namespace},
			Type:       secretType,
			Data:       data,
		})
	}
	e.client = fake.NewSimpleClientset(objs...)
	t.Cleanup(func() { cleanupMounts(t, e.root) })
	return e
}

// installed remembers, per interpreter, node config and driver name, the executable
// `flexhub install` wrote first in this process (its bytes: that test's directory goes with it). Each test has its own plugin directory; the
// installer's output does not depend on it (the shim names the interpreter and the config), so
// later tests get a copy of that executable, written as the installer writes it (0755
// directories, an 0755 file), instead of another `flexhub install`, which costs about 10 s in
// the emulated VM. The installer itself is run by the first test, and refused names by
// TestDriverDirectory, every time.
var installed = map[string][]byte{}

// installDriver runs `flexhub install` into pluginDir (or copies what it wrote for the same
// arguments, above) and applies the break mode.
func installDriver(t *testing.T, cfg config, pluginDir, driver string) string {
	t.Helper()
	dirName := strings.ReplaceAll(driver, "/", "~")
	exe := filepath.Join(pluginDir, dirName, driver[strings.LastIndex(driver, "/")+1:])
	key := strings.Join([]string{cfg.python, cfg.nodeConfig, driver}, "\x00")
	if body, ok := installed[key]; ok && cfg.breakMode == "" {
		if err := os.MkdirAll(filepath.Dir(exe), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(exe, body, 0o755); err != nil {
			t.Fatal(err)
		}
		return exe
	}
	argv := []string{"-m", "flexhub", "install", "--plugin-dir", pluginDir, "--driver", driver}
	if cfg.nodeConfig != "" {
		argv = append(argv, "--config", cfg.nodeConfig)
	}
	if out, err := exec.Command(cfg.python, argv...).CombinedOutput(); err != nil {
		t.Fatalf("flexhub install: %v\n%s", err, out)
	}
	if cfg.breakMode != "" { // a broken driver is installed anew each time, then broken
		applyBreak(t, cfg.breakMode, exe)
		return exe
	}
	body, err := os.ReadFile(exe)
	if err != nil {
		t.Fatal(err)
	}
	installed[key] = body
	return exe
}

// start boots a kubelet over the env: GetDynamicPluginProber → InitPlugins →
// FindPluginByName (which execs `init`).
func (e *env) start(t *testing.T) *kubelet {
	t.Helper()
	return e.startNamed(t, driverName)
}

func (e *env) startNamed(t *testing.T, name string) *kubelet {
	t.Helper()
	k, err := e.tryStart(t, name)
	if err != nil {
		t.Fatalf("FindPluginByName(%q): %v (calls: %v)", name, err, k.rec.ops())
	}
	return k
}

func (e *env) tryStart(t *testing.T, name string) (*kubelet, error) {
	t.Helper()
	rec := newRecorder(t)
	fakeHost := volumetest.NewFakeKubeletVolumeHost(t, e.root, e.client, nil)
	host := &realHost{VolumeHost: fakeHost}
	prober := flexvolume.GetDynamicPluginProber(t.Context(), e.pluginDir, rec)
	mgr := &volume.VolumePluginMgr{}
	if err := mgr.InitPlugins(nil, prober, host); err != nil {
		t.Fatalf("InitPlugins: %v", err)
	}
	k := &kubelet{t: t, rec: rec, host: host, mgr: mgr, root: e.root}
	plugin, err := mgr.FindPluginByName(name)
	k.plugin = plugin
	return k, err
}

func cleanupMounts(t *testing.T, root string) {
	// Whatever a failed test left mounted under the kubelet root: unmount it (deepest first)
	// so that the temp dir can go; a passing test leaves nothing.
	data, err := os.ReadFile("/proc/self/mounts")
	if err != nil {
		return
	}
	var left []string
	for _, line := range strings.Split(string(data), "\n") {
		f := strings.Fields(line)
		if len(f) > 1 && strings.HasPrefix(f[1], root+"/") {
			left = append(left, f[1])
		}
	}
	for i := len(left) - 1; i >= 0; i-- {
		t.Errorf("left mounted after the test: %s", left[i])
		_ = exec.Command("umount", "-l", left[i]).Run()
	}
}

// ---- specs and pods -----------------------------------------------------------------------

func newPod(name string) *v1.Pod {
	return &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace, UID: types.UID(fmt.Sprintf("uid-%s-%d", name, time.Now().UnixNano()))},
		Spec:       v1.PodSpec{ServiceAccountName: "sa-" + name},
	}
}

func (e *env) pv(name string, size int64) *v1.PersistentVolume {
	src := &v1.FlexPersistentVolumeSource{Driver: driverName, FSType: e.cfg.fsType, Options: copyMap(e.cfg.options)}
	if e.cfg.secret != nil {
		src.SecretRef = &v1.SecretReference{Name: secretName}
	}
	fs := v1.PersistentVolumeFilesystem
	return &v1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: v1.PersistentVolumeSpec{
			Capacity:               v1.ResourceList{v1.ResourceStorage: *resource.NewQuantity(size, resource.BinarySI)},
			PersistentVolumeSource: v1.PersistentVolumeSource{FlexVolume: src},
			AccessModes:            []v1.PersistentVolumeAccessMode{v1.ReadWriteOnce},
			VolumeMode:             &fs,
		},
	}
}

func (e *env) inline(name string, options map[string]string) *volume.Spec {
	src := &v1.FlexVolumeSource{Driver: driverName, FSType: e.cfg.fsType, Options: copyMap(options)}
	if e.cfg.secret != nil {
		src.SecretRef = &v1.LocalObjectReference{Name: secretName}
	}
	return volume.NewSpecFromVolume(&v1.Volume{Name: name, VolumeSource: v1.VolumeSource{FlexVolume: src}})
}

func copyMap(m map[string]string) map[string]string {
	out := make(map[string]string, len(m))
	for k, v := range m {
		out[k] = v
	}
	return out
}

// ---- helpers over the real node -----------------------------------------------------------

func isMounted(t *testing.T, dir string) bool {
	t.Helper()
	notMnt, err := mount.New("").IsLikelyNotMountPoint(dir)
	if err != nil {
		if os.IsNotExist(err) {
			return false
		}
		t.Fatalf("IsLikelyNotMountPoint(%s): %v", dir, err)
	}
	return !notMnt
}

func exists(path string) bool {
	_, err := os.Lstat(path)
	return err == nil
}

// oneCall asserts that exactly one driver call was made since mark, of operation op, and
// returns it.
func (k *kubelet) oneCall(mark int, op string) call {
	k.t.Helper()
	calls := k.rec.since(mark)
	if len(calls) != 1 || calls[0].op() != op {
		ops := []string{}
		for _, c := range calls {
			ops = append(ops, c.op())
		}
		k.t.Fatalf("expected exactly one %q call, the real code made %v", op, ops)
	}
	return calls[0]
}

func (k *kubelet) noCalls(mark int, what string) {
	k.t.Helper()
	if calls := k.rec.since(mark); len(calls) != 0 {
		k.t.Fatalf("%s: expected no driver call, the real code made %d (first: %v)", what, len(calls), maskArgv(calls[0].Argv[1:]))
	}
}

func runArgv(t *testing.T, argv []string) {
	t.Helper()
	out, err := exec.Command(argv[0], argv[1:]...).CombinedOutput()
	if err != nil {
		t.Fatalf("%v: %v\n%s", argv, err, out)
	}
}
